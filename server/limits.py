"""Request-body limits checked before any handler or tokenizer sees the body.

`BodyGuard` is an ASGI middleware for every request that carries a body
(every POST; no route takes PUT or PATCH). In order, cheapest first:

1. `Content-Type`: a JSON route takes `application/json` (or a `+json` type).
   Admin routes (`/v1/adapters`) require it; the generation routes also take a
   request without a Content-Type (scripts), but never `text/plain`, a form or
   multipart: those are the types a web page can send without a CORS preflight.
2. Body bytes: a `Content-Length` over the limit is refused before reading; a
   chunked body is counted while read and refused as soon as it passes the
   limit (413). The whole body must arrive within `body_timeout_s` (408).
3. JSON structure, measured on the raw bytes *before* parsing: the values the
   body holds (commas, `[` and `{` outside strings: every array element and
   object member, counted with C-speed byte counts first, strings removed only
   when that bound is near the limit) and the nesting depth (strings removed by
   one regex, brackets counted with numpy a few MB at a time). A body of
   millions of empty objects never becomes millions of Python dicts (413
   naming `--max-json-nodes`), and a 10,000-deep array never reaches the
   recursive parser (400). A body over 256 KiB is counted 1 MB per event-loop
   turn, its strings removed on one scan thread (`scan_shape`).
4. Characters of string content in the parsed body (every string value and
   key, all messages, tools and system prompts together): over the limit is a
   413 before the prompt is rendered or tokenized. Under the default limit (derived from
   the model's context) an Anthropic route answers as Anthropic does for a prompt that
   cannot fit: 400 `invalid_request_error` "prompt is too long" (clients such as Claude
   Code show that, and may compact; a 413 reads to them as "request too large"). A string
   holding an unpaired
   UTF-16 surrogate escape (`"\\ud800"`: valid JSON, not Unicode text) is a 400.

The body is then replayed unchanged to the app. Errors use the protocol's
shape (`server.errors.body_for`: the path tells the protocol).
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import APIError, body_for, is_anthropic_path
from .images import IMAGE_PAYLOAD_KEYS, IMAGE_TYPES

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_BODY_TIMEOUT_S = 30.0
NODES_PER_CONTEXT_TOKEN = 8       # default JSON-value limit = 8 x the model's context
MIN_MAX_JSON_NODES = 100_000
THREAD_SCAN_BYTES = 256 * 1024
SCAN_CHUNK = 4 << 20
COUNT_CHUNK = 1 << 20
_SCAN = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-scan")
CHARS_PER_CONTEXT_TOKEN = 16      # default prompt-character limit = 16 x the model's context
FALLBACK_MAX_PROMPT_CHARS = 2_000_000

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_JSON_TYPES = ("application/json",)


@dataclass(frozen=True)
class BodyLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_prompt_chars: int = 0        # 0 = 16 x the model's context (create_app)
    context_tokens: int = 0          # the model's context when the limit derives from it
    max_json_nodes: int = 0          # 0 = 8 x the model's context, at least 100,000 (create_app)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


def default_prompt_chars(context_tokens: Optional[int]) -> int:
    """16 characters per token of the model's context (a prompt that long cannot fit)."""
    if not context_tokens or context_tokens < 1:
        return FALLBACK_MAX_PROMPT_CHARS
    return int(context_tokens) * CHARS_PER_CONTEXT_TOKEN


def default_json_nodes(context_tokens: Optional[int]) -> int:
    """8 JSON values per token of the model's context, at least 100,000."""
    return max(MIN_MAX_JSON_NODES, int(context_tokens or 0) * NODES_PER_CONTEXT_TOKEN)


_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def _count(c: np.ndarray) -> int:
    return (int(np.count_nonzero(c == 44)) + int(np.count_nonzero(c == 91))
            + int(np.count_nonzero(c == 123)))            # , [ {


def _nodes_bound(raw: bytes) -> int:
    """Commas and opening brackets, strings included (an upper bound of the values)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    return 1 + sum(_count(a[i:i + COUNT_CHUNK]) for i in range(0, a.size, COUNT_CHUNK))


async def scan_shape(raw: bytes, max_nodes: int) -> tuple:
    """`json_shape` for a large body without holding up the event loop: the upper
    bound is counted 1 MB per loop turn (about a millisecond each), and the string
    removal, when needed, runs on the one scan thread."""
    a = np.frombuffer(raw, dtype=np.uint8)
    bound = 1
    for i in range(0, a.size, COUNT_CHUNK):
        bound += _count(a[i:i + COUNT_CHUNK])
        await asyncio.sleep(0)
    if bound > 4 * max_nodes:
        return bound, 0
    return await asyncio.get_running_loop().run_in_executor(_SCAN, json_shape, raw,
                                                            max_nodes, bound)


def json_depth(raw: bytes, bare: Optional[bytes] = None) -> int:
    """Maximum nesting depth of `[`/`{` in a JSON text (0 for a scalar).

    Strings are removed first (one C-speed regex pass; `bare`: already done),
    then the brackets are counted with a cumulative sum, a few MB at a time;
    exact for valid JSON, and never below the true depth for malformed input
    (which the parser then refuses)."""
    bare = _STRING.sub(b"", raw) if bare is None else bare
    a = np.frombuffer(bare, dtype=np.uint8)
    depth = best = 0
    for i in range(0, a.size, SCAN_CHUNK):
        s = np.cumsum(_STEP[a[i:i + SCAN_CHUNK]], dtype=np.int64) + depth
        best, depth = max(best, int(s.max())), int(s[-1])
    return best


def json_shape(raw: bytes, max_nodes: int, bound: Optional[int] = None) -> tuple:
    """(values, depth) of a JSON text, values counted as commas and opening
    brackets outside strings. When even the count with strings included is
    more than 4 x `max_nodes`, that count is returned (and depth 0) without
    removing the strings (the cost of which grows with the strings' number)."""
    bound = _nodes_bound(raw)
    if bound > 4 * max_nodes:
        return bound, 0
    bare = _STRING.sub(b"", raw)
    nodes = bound if bound <= max_nodes else _nodes_bound(bare)
    return nodes, json_depth(raw, bare)


def string_chars(value) -> int:
    """Total characters of every string (values and keys) inside a parsed JSON value, an
    image part's payload left out (its base64 is not prompt text: --max-image-mb and
    --max-body-mb cap it)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            image = v.get("type") in IMAGE_TYPES
            for k, x in v.items():
                total += len(k)
                if not (image and k in IMAGE_PAYLOAD_KEYS):
                    stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)
    return total


def lone_surrogate(raw: bytes, value) -> Optional[str]:
    """The first string (value or key) of a parsed body that holds a lone UTF-16 surrogate
    (`"\\ud800"` unpaired: JSON allows the escape, but it is not Unicode text and cannot
    be encoded), or None. Only bodies whose raw bytes contain a surrogate escape are walked."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _media_type(headers: dict) -> Optional[str]:
    ct = headers.get(b"content-type")
    if ct is None:
        return None
    return ct.split(b";", 1)[0].strip().lower().decode("latin-1")


def is_json_type(media: Optional[str]) -> bool:
    return media is not None and (media in _JSON_TYPES or media.endswith("+json"))


def is_admin_path(path: str) -> bool:
    """Routes that change or reveal server state (not granted to browsers by default)."""
    return path == "/stats" or path == "/v1/adapters" or path.startswith("/v1/adapters/")


class _Refused(Exception):
    def __init__(self, err: APIError):
        self.err = err


async def reply(scope, send, err: APIError, headers: Optional[dict] = None) -> None:
    body = json.dumps(body_for(scope.get("path", ""), err)).encode()
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in (headers or {}).items():
        hs.append((k.lower().encode("latin-1"), str(v).encode("latin-1")))
    await send({"type": "http.response.start", "status": err.status, "headers": hs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def too_large(what: str, size, limit: int, flag: str) -> APIError:
    return APIError(413, f"request {what} {size} exceeds the limit of {limit} ({flag})",
                    type="request_too_large")


def prompt_too_long(chars: int, lim: BodyLimits) -> APIError:
    """Anthropic's answer to a prompt over the context, for a body whose text alone cannot
    fit (more than CHARS_PER_CONTEXT_TOKEN characters per token of the context)."""
    return APIError(400, f"prompt is too long: {chars} characters of text cannot fit this "
                         f"model's context of {lim.context_tokens} tokens (the limit is "
                         f"{lim.max_prompt_chars} characters, --max-prompt-chars). Shorten "
                         f"the prompt.", code="context_length_exceeded")


class BodyGuard:
    """ASGI middleware: content type, body bytes, read time, JSON values and depth,
    prompt characters."""

    def __init__(self, app, limits: BodyLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            raw = await self._checked_body(scope, receive)
        except _Refused as r:
            return await reply(scope, send, r.err)
        if raw is None:        # the client left while sending
            return
        done = False

        async def replay():
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _checked_body(self, scope, receive) -> Optional[bytes]:
        lim = self.limits
        headers = dict(scope.get("headers") or [])
        media = _media_type(headers)
        admin = scope["path"].startswith("/v1/adapters")
        if not is_json_type(media) and (admin or media is not None):
            raise _Refused(APIError(
                415, "unsupported Content-Type: send the JSON body with "
                     "Content-Type: application/json", type="invalid_request_error"))
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise _Refused(APIError(400, "invalid Content-Length header")) from None
            if n > lim.max_body_bytes:
                raise _Refused(too_large("body of", f"{n} bytes", lim.max_body_bytes,
                                         "--max-body-mb"))
        raw = await self._read(receive)
        if raw is None:
            return None
        if not raw.strip():
            return raw        # the handler answers "the body is empty"
        max_nodes = lim.max_json_nodes or MIN_MAX_JSON_NODES
        if len(raw) > THREAD_SCAN_BYTES:      # (the event loop keeps answering)
            nodes, depth = await scan_shape(raw, max_nodes)
        else:
            nodes, depth = json_shape(raw, max_nodes)
        if nodes > max_nodes:
            raise _Refused(too_large("body of", f"{nodes} JSON values", max_nodes,
                                     "--max-json-nodes"))
        if depth > lim.max_json_depth:
            raise _Refused(APIError(400, f"invalid JSON body: nested {depth} levels deep, "
                                         f"the limit is {lim.max_json_depth} "
                                         f"(--max-json-depth)"))
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            return raw        # the handler answers with the parser's message
        if lone_surrogate(raw, parsed) is not None:
            raise _Refused(APIError(400, "invalid JSON body: a string holds an unpaired UTF-16 "
                                         "surrogate escape (such as \\ud800), which is not "
                                         "Unicode text"))
        chars = string_chars(parsed)
        if chars > lim.max_prompt_chars and lim.context_tokens and is_anthropic_path(
                scope["path"]):
            raise _Refused(prompt_too_long(chars, lim))
        if chars > lim.max_prompt_chars:
            raise _Refused(too_large("text of", f"{chars} characters", lim.max_prompt_chars,
                                     "--max-prompt-chars"))
        return raw

    async def _read(self, receive) -> Optional[bytes]:
        lim = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + lim.body_timeout_s
        chunks, size = [], 0
        while True:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                msg = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise _Refused(APIError(408, f"the request body did not arrive within "
                                             f"{lim.body_timeout_s:g} s")) from None
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > lim.max_body_bytes:
                raise _Refused(too_large("body of more than", f"{lim.max_body_bytes} bytes",
                                         lim.max_body_bytes, "--max-body-mb"))
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
