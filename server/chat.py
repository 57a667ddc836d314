"""The one call path: a protocol-neutral request in, neutral events out.

Each protocol module (openai, anthropic, responses) only translates its wire
format into a `Call` (`server.call`: messages in the Hugging Face chat-template
shape, or a raw prompt; sampling; stop strings; tools; adapters) and renders the events
`Generation.events()` yields:

    Text(text, logprobs)   content to show (tool markup already withheld)
    Reasoning(text)        reasoning (thinking) text, split out of the content
    Tool(call)             one tool call (engine.text.tools.ToolCall; `call.cut`: the
                           token limit ended it, its complete arguments only)
    Done(...)              finish reason and usage

`start()` validates, renders the prompt, checks memory admission and queues
the generation on the gateway; it returns only once the first output is
back (or raises `APIError` for a client mistake), so an error is a proper
4xx response, never a broken stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Optional

from engine import GrammarDeadEnd
from . import sse
from .constraints import (check_tool_schemas, compile_factories, constraint_param,
                          processor_factories)
from .call import Call, context_left, encode_async, sampling_params, uncapped
from .errors import APIError, from_exception
from .gateway import GenerationJob, client_error
from .models_lease import model_lease

log = logging.getLogger("engine-serve")



@dataclass
class Text:
    text: str
    logprobs: list = field(default_factory=list)


@dataclass
class Reasoning:
    text: str     # reasoning (thinking) text, split out of the content


@dataclass
class Tool:
    call: Any  # engine.text.tools.ToolCall


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
    reasoning: str = ""           # all reasoning shown
    reasoning_tokens: int = 0     # generated tokens inside reasoning (markers included)


# --- the engine call ----------------------------------------------------------


PROMPT_TAIL_TOKENS = 64    # enough of the prompt's end to see an open reasoning block


def make_parser(state, call: Call, prompt_ids: list):
    """The output parser of a chat call: reasoning split out (for a family that
    thinks) and tool calls read from the content; None for plain text
    (a raw-prompt completion, or no reasoning markers and no tools)."""
    from engine import ChatOutputParser, reasoning_format_for, starts_in_reasoning
    from engine import tool_format_for

    if call.messages is None:
        return None
    fmt = reasoning_format_for(state.tokenizer)
    # the chat template's format first (MiniCPM5 checkpoints are model_type llama)
    tool_fmt = tool_format_for(state.tokenizer, state.model_type) if call.tools else None
    if fmt is None and tool_fmt is None:
        return None
    opened = False
    if fmt is not None:
        tail = state.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
        opened = starts_in_reasoning(tail, fmt)
    return ChatOutputParser(fmt, tool_fmt, call.tools if tool_fmt else None, in_reasoning=opened)


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
    def first_output(self):
        return self._first[0] if self._first else None

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
        """Wait for the first output; raise APIError for a client error."""
        items = await self.job.get_batch()
        for out in items:
            if client_error(out) or isinstance(out.error, APIError):
                self.stop_watching()
                raise from_exception(out.error)
        self._first = items

    # --- events -----------------------------------------------------------

    def _emit(self, evs, out: list, pending_lp: list) -> list:
        """Router events (or plain Text) into `out`; returns the logprobs not yet
        attached to a Text event."""
        from engine import ReasoningDelta

        for ev in evs:
            if hasattr(ev, "arguments_json"):
                self._calls.append(ev)
                out.append(Tool(ev))
            elif isinstance(ev, ReasoningDelta):
                self._reasoning.append(ev.text)
                out.append(Reasoning(ev.text))
            else:
                self._text.append(ev.text)
                out.append(Text(ev.text, pending_lp))
                pending_lp = []
        return pending_lp

    async def events(self) -> AsyncIterator[list]:
        """Batches of events (Text / Tool / Done); the last batch ends with Done
        (or raises APIError(500) for a server fault mid-generation)."""
        self._text, self._calls, self._reasoning = [], [], []
        self._reasoning_tokens = 0
        lps_all, ids_all, pending_lp = [], [], []
        items, self._first = self._first, []
        try:
            while True:
                if not items:
                    # coalesced: at most one batch per --stream-interval-ms (the job's)
                    items = await self.job.get_batch()
                events: list = []
                for o in items:
                    if o.finish_reason == "error":
                        if isinstance(o.error, APIError):   # the server's own answer (a 503)
                            raise o.error
                        if isinstance(o.error, GrammarDeadEnd):   # never a success
                            param = constraint_param(self.call)
                            raise APIError(400, f"{param}: {o.error}", param=param,
                                           code="grammar_dead_end")
                        client = client_error(o)
                        raise APIError(400 if client else 500,
                                       f"generation failed: {type(o.error).__name__}: {o.error}",
                                       type="invalid_request_error" if client else "server_error")
                    ids_all.extend(o.token_ids)
                    lps_all.extend(o.logprobs)
                    pending_lp.extend(o.logprobs)
                    was = self.router is not None and self.router.in_reasoning
                    if o.text:
                        evs = [Text(o.text)] if self.router is None else self.router.feed(o.text)
                        pending_lp = self._emit(evs, events, pending_lp)
                    if was or (self.router is not None and self.router.in_reasoning):
                        self._reasoning_tokens += len(o.token_ids)    # (markers count too)
                    if o.finished:
                        if self.router is not None:
                            cut = o.finish_reason == "length"   # (a tool call it cut)
                            pending_lp = self._emit(self.router.finish(cut=cut), events,
                                                    pending_lp)
                        self.done = self._done(o, ids_all, lps_all)
                        events.append(self.done)
                        yield events
                        return
                items = []
                if events:
                    yield events
        finally:
            self.stop_watching()
            if self.done is None:
                self.job.cancel()

    def _done(self, last, ids, lps) -> Done:
        finish = last.finish_reason
        stop_string = last.stop_string if finish == "stop" else None
        if self._calls and finish not in ("cancelled", "length"):
            finish = "tool_calls"       # (the token limit's end stays length: a call it cut)
        prompt_tokens = last.prompt_tokens or len(self.prompt_ids)
        return Done(finish, prompt_tokens, last.generation_tokens, last.cached_tokens,
                    stop_string, lps, "".join(self._text), self._calls, ids,
                    "".join(self._reasoning), self._reasoning_tokens)


async def start(state, call: Call, request=None) -> Generation:
    """Validate, render, admit and queue; returns once the first output is back."""
    params = sampling_params(state, call)
    try:
        adapters = (state.default_adapters if call.adapter == "__default__"
                    else state.adapters.resolve(call.adapter))
    except ValueError as e:
        raise from_exception(e) from None
    await check_tool_schemas(call.tools)
    ids = await encode_async(state, call)
    if uncapped(state, call):
        params = dataclasses.replace(params, max_tokens=context_left(state, len(ids)))
    # context length, then memory admission, before queueing (the engine re-checks both)
    try:
        state.engine.check_context(len(ids))
        # a cap past the model's context (Claude Code asks 32,000-128,000 of any model) is
        # the context left: generation ends where the context does (finish "length")
        params = state.engine.capped(params, len(ids))
        state.admission.check(len(ids), params.max_tokens)
    except ValueError as e:
        raise from_exception(e) from None
    state.check_capacity()                       # bounded queue: 503 + Retry-After beyond it
    lease = model_lease(request, state)
    if lease is not None:      # several models: this request's KV under the shared budget
        params = replace(params, max_tokens=await lease.reserve(
            state, len(ids), params.max_tokens, uncapped(state, call)))
    # the grammar last (it may take seconds): on the grammar threads, within its budget
    factories = await compile_factories(state, call, processor_factories)
    if factories:
        params = replace(sampling_params(state, call, factories), max_tokens=params.max_tokens)
    router = make_parser(state, call, ids)
    job = GenerationJob(asyncio.get_running_loop(), ids, params, adapters)
    job.vision = call.vision
    job.interval = state.config.stream_interval_ms / 1000.0
    gen = Generation(state, call, job, ids, router)
    if lease is not None:
        lease.attach(job)      # the reservation lasts until the job ends
    if request is not None:
        gen.watch_disconnect(request)
        # an error answered after this point (the route's own rendering) cancels the job
        request.state.generations = [*getattr(request.state, "generations", ()), gen]
    state.gateway.submit(job)
    try:
        await gen.wait_first()
    except BaseException:
        gen.cancel()
        raise
    return gen


def cancel_generations(request) -> None:
    """Cancel the generations this request queued (its answer is an error: no one will
    read them). A finished job ignores it."""
    for gen in getattr(request.state, "generations", ()):
        gen.cancel()


def stream(gen: Generation, render, head: bytes, error_frame):
    """The SSE response of a streamed generation: `head`, then `render.feed(events)`
    per batch; an APIError mid-stream becomes the protocol's `error_frame(e)`."""
    async def body():
        try:
            if head:
                yield head
            async for batch in gen.events():
                b = render.feed(batch)
                if b:
                    yield b
        except APIError as e:
            yield error_frame(e)
        finally:
            gen.cancel()
    gen.stop_watching()
    return sse.response(body())


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
