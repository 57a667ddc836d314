"""Images in requests, from the three protocols' wire shapes to the engine's
`vision_prompt` (the server only translates; decoding and preprocessing are the engine's).

- OpenAI chat: `{"type": "image_url", "image_url": {"url": ...}}` (or the URL as a string);
- Anthropic Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`
  (or `{"type": "url", "url"}`);
- OpenAI Responses: `{"type": "input_image", "image_url": ...}`.

`data:` URLs (base64) always; http(s) URLs only with `--allow-image-urls`, fetched on a pool
of their own with a size cap and a deadline (`--image-url-timeout` for the whole fetch), from
the address checked when the host was resolved, never from a non-global address (loopback,
link-local, private, shared, reserved) unless `--allow-private-image-urls`. While a protocol's messages are normalized
(`collect`), each image part becomes the marker U+FFFC in the message's text; `as_parts`
turns the markers into the templates' `{"type": "image"}` parts."""

from __future__ import annotations

import base64
import binascii
import contextvars
import http.client
import ipaddress
import socket
import ssl
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

from .errors import bad_request

MARK = "\ufffc"          # an image part's place in a message's text
IMAGE_TYPES = ("image_url", "image", "input_image")
IMAGE_PAYLOAD_KEYS = ("image_url", "source")    # an image part's keys that hold the image
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_URL_TIMEOUT_S = 10.0
MAX_IMAGES = 16


@dataclass
class ImageRef:
    data: Optional[bytes] = None      # decoded data: URL / base64 source
    url: Optional[str] = None         # an http(s) URL, fetched by `fetch_urls`
    where: str = "image"


@dataclass
class Collector:
    vision: bool
    refs: list


_active: contextvars.ContextVar = contextvars.ContextVar("image_collector", default=None)


@contextmanager
def collect(state):
    """Collect the image parts of the messages normalized inside (into the yielded list)."""
    from engine import has_vision
    refs: list = []
    token = _active.set(Collector(has_vision(getattr(state, "model", None)), refs))
    try:
        yield refs
    finally:
        _active.reset(token)


def _media_type(media, where: str) -> None:
    """A declared media type must be an image's or none/generic bytes (a browser's
    FileReader names a file of unknown type application/octet-stream); the bytes then
    decide the format."""
    if media is None or str(media).strip().lower() in ("", "application/octet-stream"):
        return
    if not isinstance(media, str) or not media.strip().lower().startswith("image/"):
        raise bad_request(f"{where}: the image's media type must be image/* (such as "
                          f"image/png), got {str(media)[:64]!r}")


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise bad_request(f"{where}: a data: URL must be data:<type>;base64,<data>")
    _media_type(head[5:-7].split(";")[0], where)
    return _b64(payload, where)


def _b64(payload, where: str) -> bytes:
    if not isinstance(payload, str):
        raise bad_request(f"{where}: the image data must be a base64 string")
    if not payload:
        raise bad_request(f"{where}: the image data is empty")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the image data is not valid base64") from None


def _from_url(url, where: str) -> ImageRef:
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: the image needs a URL (a data: URL or http(s))")
    if url.startswith("data:"):
        return ImageRef(data=_data_url(url, where), where=where)
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
    except ValueError:
        scheme = None
    if scheme in ("http", "https"):
        _split(url)                  # (a malformed host or port: a 400 now)
        return ImageRef(url=url, where=where)
    raise bad_request(f"{where}: image URLs must be data: or http(s) URLs")


def image_part(part: dict, where: str) -> str:
    """An image part of any protocol, recorded in the active collector: its MARK.
    A 400 when images are not taken here or the part is malformed."""
    c = _active.get()
    if c is None or not c.vision:
        raise bad_request(f"{where}: {part.get('type')} content is not supported: this model "
                          "has no vision tower")
    t = part.get("type")
    if t == "image_url":
        v = part.get("image_url")
        ref = _from_url(v.get("url") if isinstance(v, dict) else v, where)
    elif t == "input_image":
        ref = _from_url(part.get("image_url"), where)
    else:                                    # Anthropic's image block
        src = part.get("source")
        if not isinstance(src, dict):
            raise bad_request(f"{where}: an image block needs a source object")
        if src.get("type") == "base64":
            _media_type(src.get("media_type"), where)
            ref = ImageRef(data=_b64(src.get("data"), where), where=where)
        elif src.get("type") == "url":
            ref = _from_url(src.get("url"), where)
        else:
            raise bad_request(f"{where}: image source type must be base64 or url")
    if len(c.refs) >= MAX_IMAGES:
        raise bad_request(f"at most {MAX_IMAGES} images per request")
    c.refs.append(ref)
    return MARK


def as_parts(messages: list, count: int) -> list:
    """Messages whose text holds MARKs with `{"type": "image"}` parts in their places."""
    seen, out = 0, []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str) and MARK in c:
            if m.get("role") != "user":
                raise bad_request(f"images are accepted in user messages only (a {m.get('role')!r} "
                                  "message holds one)")
            parts = []
            for i, piece in enumerate(c.split(MARK)):
                if i:
                    parts.append({"type": "image"})
                    seen += 1
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts}
        out.append(m)
    if seen != count:
        raise bad_request("the messages' text may not contain U+FFFC (the image marker)")
    return out


def _split(url: str):
    """(scheme, host, port, path with query) of an http(s) URL; a 400 when it is malformed."""
    try:
        u = urllib.parse.urlsplit(url)
        host, port = u.hostname, u.port
    except ValueError as e:          # a bad bracketed host, a port that is not a number
        raise bad_request(f"the image URL is malformed ({e})") from None
    if not host:
        raise bad_request("the image URL has no host")
    scheme = u.scheme.lower()
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return scheme, host, port or (443 if scheme == "https" else 80), path


def _resolve(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to: the host resolved once (the connection goes to this very
    address, so a name cannot answer a public address here and a private one to the
    connection); a 400 when any of its addresses is not a global one (loopback, link-local,
    private, shared, reserved...) unless private addresses are allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise bad_request(f"image URL host {host!r} does not resolve ({e})") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if not allow_private and (not ip.is_global or ip.is_multicast):
            raise bad_request(f"image URL host {host!r} is a loopback, link-local, private or "
                              "other non-global address (--allow-private-image-urls to allow)")
    return infos[0][4][0]


class _Pinned(http.client.HTTPSConnection):
    """HTTPS to an address resolved beforehand, the certificate checked for the URL's host."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self):
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def fetch(url: str, max_bytes: int, timeout: float, allow_private: bool) -> bytes:
    """The body of a GET of `url` (redirects not followed: one could point anywhere), at most
    `max_bytes`, within `timeout` seconds in all (a deadline, not a limit on each read)."""
    scheme, host, port, path = _split(url)
    address = _resolve(host, port, allow_private)
    if scheme == "https":
        conn = _Pinned(host, port, address, timeout)
    else:
        conn = http.client.HTTPConnection(address, port, timeout=timeout)
    expired, held = threading.Event(), []

    def expire():           # the deadline: the socket shut, any read in progress ends
        expired.set()
        sock = held[0] if held else conn.sock   # (the response owns it once headers are read)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        netloc = host if ":" not in host else f"[{host}]"
        conn.request("GET", path, headers={
            "Host": netloc if port in (80, 443) else f"{netloc}:{port}",
            "User-Agent": "mlx-parity"})
        held.append(conn.sock)
        if expired.is_set():
            expire()
        r = conn.getresponse()
        if r.status != 200:
            raise bad_request(f"image URL answered HTTP {r.status}")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = r.read(min(65536, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except (OSError, http.client.HTTPException, ValueError) as e:
        if expired.is_set() or isinstance(e, TimeoutError):   # (the socket's own timeout can
            # fire a moment before the deadline's timer: the same limit)
            raise bad_request(f"image URL timed out (the fetch took over {timeout:g} s)") from None
        raise bad_request(f"image URL could not be fetched ({type(e).__name__})") from None
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        raise bad_request(f"image URL timed out (the fetch took over {timeout:g} s)")
    if len(data) > max_bytes:
        raise bad_request(f"image at URL is over {max_bytes:,} bytes")
    return data


_FETCH_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="image-url")


async def fetch_urls(refs: list, config) -> None:
    """Fetch the http(s) images of `refs` (their `data` set) on a pool of their own: a slow
    URL waits there, never on the threads other requests encode on (each fetch ends by its
    deadline). A 400 when URLs are off on this server or a fetch fails."""
    import asyncio

    urls = [r for r in refs if r.data is None]
    if not urls:
        return
    if not getattr(config, "allow_image_urls", False):
        raise bad_request(f"{urls[0].where}: http(s) image URLs are off on this server "
                          "(--allow-image-urls); send the image as a data: URL")
    loop = asyncio.get_running_loop()
    cap = getattr(config, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES)
    timeout = getattr(config, "image_url_timeout", DEFAULT_URL_TIMEOUT_S)
    private = getattr(config, "allow_private_image_urls", False)
    for ref in urls:
        ref.data = await loop.run_in_executor(_FETCH_POOL, fetch, ref.url, cap, timeout, private)


def image_bytes(refs: list, config) -> list:
    """The images' bytes, each within the size cap (http(s) images: fetched by `fetch_urls`
    before the encode, which every route awaits)."""
    cap = getattr(config, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES)
    for ref in refs:
        if ref.data is None:
            raise RuntimeError("image URLs are fetched by fetch_urls before the encode")
        if len(ref.data) > cap:
            raise bad_request(f"{ref.where}: the image is over {cap:,} bytes")
    return [ref.data for ref in refs]


def vision_encode(state, call) -> tuple:
    """(prompt ids, engine.VisionInput) of a call with images; a 400 for any bad image."""
    from engine import PromptError

    if getattr(state.config, "tensor_parallel", False):
        raise bad_request("images are not supported on a tensor-parallel server")
    data = image_bytes(call.images, state.config)
    messages = as_parts(call.messages, len(data))
    try:
        return state.engine.vision_prompt(messages, data, tools=call.tools,
                                          template_kwargs=call.template_kwargs)
    except PromptError as e:
        raise bad_request(str(e)) from None
