"""The one call path: a protocol-neutral request in, neutral events out.

Each protocol module (openai, anthropic, responses) only translates its wire
format into a `Call` (messages in the Hugging Face chat-template shape, or a
raw prompt; sampling; stop strings; tools; adapters) and renders the events
`run()` yields:

    Text(text, logprobs)   content to show (tool markup already withheld)
    Tool(call)             one complete tool call (engine.tools.ToolCall)
    Done(...)              finish reason and usage

`start()` validates, renders the prompt, checks memory admission and queues
the generation on the gateway; it returns only once the first segment is
back (or raises `APIError` for a client mistake), so an error is a proper
4xx response, never a broken stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from . import fields as F
from .errors import APIError, bad_request, from_exception
from .gateway import GenerationJob

log = logging.getLogger("engine-serve")

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class Text:
    text: str
    logprobs: list = field(default_factory=list)


@dataclass
class Tool:
    call: Any  # engine.tools.ToolCall


@dataclass
class Done:
    finish_reason: str            # stop | length | tool_calls | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_string: Optional[str] = None
    logprobs: list = field(default_factory=list)
    text: str = ""                # all content shown
    tool_calls: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)


@dataclass
class Call:
    """A protocol-neutral generation request."""
    messages: Optional[list] = None        # chat messages (template applied), or
    prompt: Any = None                     # raw text / token ids (no template)
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: Optional[list] = None           # OpenAI function tools (None = no tools)
    template_kwargs: dict = field(default_factory=dict)
    adapter: Any = "__default__"           # request's adapter field ("__default__" = absent)


# --- message normalization (shared by the protocols) ------------------------


def parse_arguments(args):
    """Tool-call arguments as the template wants them (a dict when it is JSON)."""
    if isinstance(args, str):
        try:
            v = json.loads(args) if args.strip() else {}
            return v if isinstance(v, dict) else args
        except ValueError:
            return args
    return args if args is not None else {}


def normalize_tool_calls(calls, where: str) -> list:
    if not isinstance(calls, list):
        raise bad_request(f"{where}: tool_calls must be an array")
    out = []
    for j, tc in enumerate(calls):
        if not isinstance(tc, dict):
            raise bad_request(f"{where}: tool_calls[{j}] must be an object")
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}: tool_calls[{j}] needs a function name")
        out.append({"id": tc.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": name, "arguments": parse_arguments(fn.get("arguments"))}})
    return out


def normalize_chat_messages(messages) -> list:
    """OpenAI chat messages -> the template's message dicts (validated)."""
    if not isinstance(messages, list):
        raise bad_request("messages must be an array", param="messages")
    if not messages:
        raise bad_request("messages required: the array is empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                              param="messages")
        if role == "developer":
            role = "system"
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise bad_request(f"{where}.content is required (only an assistant message with "
                              "tool_calls may leave it out)", param="messages")
        msg = {"role": role, "content": F.text_content(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = normalize_tool_calls(m["tool_calls"], where)
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def normalize_tools(tools, where: str = "tools") -> Optional[list]:
    """OpenAI function tools (nested or flat); non-function tool types dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"{where} must be an array", param=where)
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"{where}[{i}] must be an object", param=where)
        typ = t.get("type", "function")
        if typ not in ("function", "custom", None):
            continue  # built-in / server tools (web_search, ...) are dropped
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}[{i}] needs a non-empty function name", param=where)
        params = fn.get("parameters", fn.get("input_schema"))
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"{where}[{i}].parameters must be an object", param=where)
        if fn is not t and "parameters" in fn:
            out.append({"type": "function", "function": fn})   # as sent (key order kept)
            continue
        f = {"name": name}
        if isinstance(fn.get("description"), str):
            f["description"] = fn["description"]
        f["parameters"] = params
        out.append({"type": "function", "function": f})
    return out or None


def sampling_from(body: dict, call: Call, state) -> None:
    """The sampling fields every protocol shares (request values; None = absent)."""
    call.temperature = F.number(body, "temperature", lo=0)
    call.top_p = F.number(body, "top_p", lo=0, hi=1)
    call.top_k = F.integer(body, "top_k", lo=0)
    call.min_p = F.number(body, "min_p", lo=0, hi=1)
    call.repetition_penalty = F.number(body, "repetition_penalty", lo=0)
    call.repetition_context_size = F.integer(body, "repetition_context_size", lo=1)
    call.presence_penalty = F.number(body, "presence_penalty")
    call.frequency_penalty = F.number(body, "frequency_penalty")
    call.seed = F.integer(body, "seed")
    call.logit_bias = F.logit_bias(body, "logit_bias", state.vocab_size)
    if "adapter" in body:
        call.adapter = body["adapter"]
    elif "adapters" in body and isinstance(body["adapters"], (str, list)):
        call.adapter = body["adapters"]


def template_kwargs_from(body: dict, state, key: str = "chat_template_kwargs") -> dict:
    kw = dict(state.config.template_kwargs)
    if state.config.thinking is not None:
        kw["enable_thinking"] = state.config.thinking
    effort = body.get("reasoning_effort")
    if isinstance(effort, str):
        kw["enable_thinking"] = effort.lower() != "none"
    req = F.obj(body, key)
    if req:
        kw.update(req)
    return kw


# --- the engine call ----------------------------------------------------------


def _resolve_options(state, call: Call) -> dict:
    cfg = state.config
    opts = dict(max_tokens=call.max_tokens if call.max_tokens is not None else cfg.max_tokens,
                temperature=call.temperature if call.temperature is not None else cfg.temperature,
                top_p=call.top_p if call.top_p is not None else cfg.top_p,
                top_k=call.top_k if call.top_k is not None else cfg.top_k,
                min_p=call.min_p if call.min_p is not None else cfg.min_p,
                repetition_penalty=call.repetition_penalty,
                presence_penalty=call.presence_penalty, frequency_penalty=call.frequency_penalty,
                logit_bias=call.logit_bias, seed=call.seed, stop=list(call.stop) or None,
                logprobs=bool(call.logprobs or call.top_logprobs),
                top_logprobs=call.top_logprobs or None)
    if call.repetition_context_size is not None:
        opts["repetition_context_size"] = call.repetition_context_size
    # range checks up front (a 400 before queueing), with the engine's own rules
    from engine.sampling import make_sampler
    from engine.generation import sampling_defaults
    d = sampling_defaults(state.tokenizer)
    try:
        make_sampler(temp=d["temperature"] if opts["temperature"] is None else opts["temperature"],
                     top_p=d["top_p"] if opts["top_p"] is None else opts["top_p"],
                     min_p=d["min_p"] if opts["min_p"] is None else opts["min_p"],
                     top_k=d["top_k"] if opts["top_k"] is None else opts["top_k"])
    except ValueError as e:
        raise bad_request(str(e)) from None
    if not isinstance(opts["max_tokens"], int) or opts["max_tokens"] < 1:
        raise bad_request("max_tokens must be a positive integer", param="max_tokens")
    if opts["top_logprobs"] is not None and not 0 <= opts["top_logprobs"] <= 20:
        raise bad_request("top_logprobs must be between 0 and 20", param="top_logprobs")
    return opts


def encode(state, call: Call) -> list:
    from engine.generation import PromptError, encode_prompt

    try:
        if call.messages is not None:
            ids = encode_prompt(state.tokenizer, call.messages, call.tools, call.template_kwargs)
        else:
            ids = encode_prompt(state.tokenizer, call.prompt)
    except PromptError as e:
        raise bad_request(f"prompt build failed: {e}") from None
    except (TypeError, ValueError) as e:
        raise bad_request(f"prompt build failed: {e}") from None
    if not ids:
        raise bad_request("the prompt encodes to no tokens")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary "
                          f"(size {state.vocab_size})")
    return ids


def check_constraints(response_format, tool_choice, tools,
                      format_param: str = "response_format") -> None:
    """Known fields with values we cannot honour are a 400 naming the field: an
    unknown response format type or a bad schema, a tool_choice naming a tool
    that is not among the tools (or forcing a call with no tools)."""
    from engine.constrained import ConstraintError, parse_response_format, parse_tool_choice
    try:
        parse_response_format(response_format, param=format_param)
        if tool_choice is not None:
            parse_tool_choice(tool_choice, tools)
    except ConstraintError as e:
        raise bad_request(str(e), param=e.param) from None


def make_router(state, tools):
    if not tools:
        return None
    try:
        from engine.tools import ToolCallRouter, tool_format_for
        # the chat template's format first (MiniCPM5 checkpoints are model_type llama)
        fmt = tool_format_for(state.tokenizer, state.model_type)
    except ImportError:
        return None
    return ToolCallRouter(fmt, tools) if fmt is not None else None


class Generation:
    """A queued/running generation seen from the asyncio side."""

    def __init__(self, state, call: Call, job: GenerationJob, prompt_ids: list, router):
        self.state = state
        self.call = call
        self.job = job
        self.prompt_ids = prompt_ids
        self.router = router
        self._first: list = []
        self._watch: Optional[asyncio.Task] = None
        self.done: Optional[Done] = None

    @property
    def first_segment(self):
        for it in self._first:
            if it[0] == "seg":
                return it[1]
        return None

    # --- lifecycle ----------------------------------------------------------

    def watch_disconnect(self, request) -> None:
        """Cancel the job when the client goes away (non-streaming requests)."""
        async def watch():
            try:
                while True:
                    msg = await request.receive()
                    if msg.get("type") == "http.disconnect":
                        self.job.cancel()
                        return
            except asyncio.CancelledError:
                pass
            except Exception:  # pragma: no cover - receive channel closed
                pass
        self._watch = asyncio.ensure_future(watch())

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def cancel(self) -> None:
        self.job.cancel()
        self.stop_watching()

    async def wait_first(self) -> None:
        """Wait for the first item; raise APIError for a client error."""
        items = await self.job.get_batch()
        for it in items:
            if it[0] == "error":
                exc, client = it[1], it[2]
                if client:
                    self.stop_watching()
                    raise from_exception(exc)
        self._first = items

    # --- events -----------------------------------------------------------

    async def events(self) -> AsyncIterator[list]:
        """Batches of events (Text / Tool / Done); the last batch ends with Done
        (or raises APIError(500) for a server fault mid-generation)."""
        text_all: list = []
        raw_all: list = []
        lps_all: list = []
        ids_all: list = []
        calls: list = []
        pending_lp: list = []
        last = None
        finish = None
        router = self.router
        items = self._first
        self._first = []
        try:
            while True:
                if not items:
                    # coalesced: at most one batch per --stream-interval-ms (the job's)
                    items = await self.job.get_batch()
                out = []
                ended = False
                for it in items:
                    kind = it[0]
                    if kind == "seg":
                        seg = it[1]
                        last = seg
                        ids_all.extend(seg.token_ids)
                        if seg.logprobs:
                            lps_all.extend(seg.logprobs)
                            pending_lp.extend(seg.logprobs)
                        if seg.finish_reason:
                            finish = seg.finish_reason
                        if not seg.text:
                            continue
                        raw_all.append(seg.text)
                        if router is None:
                            text_all.append(seg.text)
                            out.append(Text(seg.text, pending_lp))
                            pending_lp = []
                            continue
                        for ev in router.feed(seg.text):
                            if hasattr(ev, "arguments_json"):
                                calls.append(ev)
                                out.append(Tool(ev))
                            else:
                                text_all.append(ev.text)
                                out.append(Text(ev.text, pending_lp))
                                pending_lp = []
                    elif kind == "end":
                        if it[1] == "cancelled":
                            finish = "cancelled"
                        ended = True
                    elif kind == "error":
                        exc, client = it[1], it[2]
                        raise APIError(400 if client else 500,
                                       f"generation failed: {type(exc).__name__}: {exc}",
                                       type="invalid_request_error" if client else "server_error")
                items = []
                if ended:
                    if router is not None:
                        for ev in router.finish():
                            if hasattr(ev, "arguments_json"):
                                calls.append(ev)
                                out.append(Tool(ev))
                            else:
                                text_all.append(ev.text)
                                out.append(Text(ev.text, pending_lp))
                                pending_lp = []
                    self.done = self._done(last, finish, "".join(text_all), calls, lps_all,
                                           ids_all, "".join(raw_all))
                    out.append(self.done)
                    yield out
                    return
                if out:
                    yield out
        finally:
            self.stop_watching()
            if self.done is None:
                self.job.cancel()

    def _done(self, last, finish, text, calls, lps, ids, raw) -> Done:
        prompt_tokens = last.prompt_tokens if last else len(self.prompt_ids)
        cached = last.cached_tokens if last else 0
        n = last.generation_tokens if last else 0
        finish = finish or "stop"
        stop_string = None
        if finish == "stop" and self.call.stop and ids:
            # A stop string (not EOS) ended it when the decoded tokens run past the
            # text the engine emitted and continue with that stop string.
            rest = self.state.tokenizer.decode(ids)[len(raw):]
            for s in self.call.stop:
                if rest.startswith(s):
                    stop_string = s
                    break
        if calls and finish != "cancelled":
            finish = "tool_calls"
        return Done(finish, prompt_tokens, n, cached, stop_string, lps, text, calls, ids)


INLINE_ENCODE_CHARS = 8192


def _input_chars(call: Call) -> int:
    if call.messages is None:
        return len(call.prompt) if isinstance(call.prompt, (str, list)) else 0
    n = sum(len(m.get("content") or "") + 64 * len(m.get("tool_calls") or ())
            for m in call.messages)
    return n + (256 * len(call.tools) if call.tools else 0)


async def start(state, call: Call, request=None) -> Generation:
    """Validate, render, admit and queue; returns once the first segment is back."""
    opts = _resolve_options(state, call)
    adapters = (state.default_adapters if call.adapter == "__default__"
                else state.adapters.resolve(call.adapter))
    # tokenizing a long prompt must not stall the stream being served; a short one is
    # encoded inline (the thread hand-off and back costs more than the encode: TTFT)
    if _input_chars(call) <= INLINE_ENCODE_CHARS:
        ids = encode(state, call)
    else:
        ids = await asyncio.to_thread(encode, state, call)
    # memory admission before queueing (the engine re-checks on the worker)
    try:
        state.admission.check(len(ids), opts["max_tokens"])
    except ValueError as e:
        raise from_exception(e) from None
    lane = getattr(state, "batch_lane", None)
    if lane is not None:
        lane.check_queue(state.gateway)          # bounded queue: 503 + Retry-After beyond it
    router = make_router(state, call.tools)
    job = GenerationJob(asyncio.get_running_loop(), ids, opts, adapters)
    job.interval = state.config.stream_interval_ms / 1000.0
    gen = Generation(state, call, job, ids, router)
    if request is not None:
        gen.watch_disconnect(request)
    state.gateway.submit(job)
    try:
        await gen.wait_first()
    except BaseException:
        gen.cancel()
        raise
    return gen


async def complete(gen: Generation, on_events=None) -> Done:
    """Drain a generation (non-streaming)."""
    async for batch in gen.events():
        if on_events is not None:
            on_events(batch)
    return gen.done


def finite(x: float) -> float:
    """JSON has no -inf: a masked token's logprob is sent as -9999.0 (as OpenAI does)."""
    return x if x == x and abs(x) != float("inf") else -9999.0


def logprob_entries(state, lps: list) -> list:
    """Engine logprobs -> OpenAI chat `logprobs.content` entries (+ token ids)."""
    tok = state.tokenizer
    out = []
    for e in lps:
        t = tok.decode([e["token"]])
        entry = {"token": t, "logprob": finite(e["logprob"]), "bytes": list(t.encode("utf-8")),
                 "id": e["token"], "top_logprobs": []}
        for tid, lp in e.get("top") or []:
            s = tok.decode([tid])
            entry["top_logprobs"].append({"token": s, "logprob": finite(lp),
                                          "bytes": list(s.encode("utf-8")), "id": tid})
        out.append(entry)
    return out
