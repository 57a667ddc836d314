"""OpenAI wire formats: `POST /v1/chat/completions` and `POST /v1/completions`.

Chat streaming (SSE, `data: <chunk>` then `data: [DONE]`): a first chunk with
`delta {role: "assistant", content: ""}`, then `{content}` increments (with
`logprobs.content` when asked), `{reasoning_content, reasoning}` increments for
the reasoning of a thinking model (split out of the content), a `{tool_calls: [{index, id, type, function}]}`
delta per completed call, and a last chunk with `delta {}`, `finish_reason`
and `usage`; with `stream_options: {"include_usage": true}` the usage comes
instead in one more chunk with `choices: []`, as OpenAI sends it (completions
likewise). A mid-stream server fault is a
`data: {"error": {...}}` frame before `[DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import sse
from .call import Call, sampling_from, template_kwargs_from
from .chat import Done, Reasoning, Text, Tool, complete, finite, logprob_entries, start
from .images import collect
from .custom_tools import call_input, custom_names
from .messages import normalize_chat_messages, normalize_tools, plain, shallow, stop_list
from .constraints import apply_constraints
from .chat import stream as chat_stream
from .models_lease import state_for
from .errors import APIError, bad_request, openai_body
from .schemas.openai import ChatCompletionRequest, CompletionRequest

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


def usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def tool_call_json(call, index=None, custom=frozenset()) -> dict:
    """A chat tool call; a call of one of the request's `custom` tools (names in `custom`) in
    OpenAI's custom shape, `{type: "custom", custom: {name, input}}`."""
    if call.name in custom:
        d = {"id": call.id, "type": "custom",
             "custom": {"name": call.name, "input": call_input(call.arguments)}}
    else:
        d = {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments_json}}
    if index is not None:
        d = {"index": index, **d}
    return d


def reasoning_fields(text: str) -> dict:
    """Reasoning under both names clients read: `reasoning_content` (DeepSeek, vLLM,
    llama.cpp) and `reasoning` (mlx-lm's server)."""
    return {"reasoning_content": text, "reasoning": text}


def _single_choice(req):
    n = req.n if req.n is not None else 1
    if n != 1:
        raise bad_request("n > 1 is not supported (one completion per request)", param="n")


# --- /v1/chat/completions ------------------------------------------------------


def parse_chat(req: ChatCompletionRequest, state) -> Call:
    """The `Call` of a validated chat request."""
    _single_choice(req)
    with collect(state) as images:
        call = Call(messages=normalize_chat_messages(shallow(req.messages)))
    call.images = images
    call.max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                       else req.max_tokens)
    sampling_from(req, call, state)
    call.stop = stop_list(req.stop)
    call.logprobs = bool(req.logprobs)
    call.top_logprobs = req.top_logprobs or 0
    tools = normalize_tools(req.tools)
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, (str, dict)):
        raise bad_request("tool_choice must be a string or an object", param="tool_choice")
    apply_constraints(call, req.response_format, choice, tools,
                      parallel=req.parallel_tool_calls is not False)
    if choice == "none":
        tools = None
    call.tools = tools
    call.template_kwargs = template_kwargs_from(req, state)
    return call


def include_usage(req, stream: bool) -> bool:
    """`stream_options: {"include_usage": true}` (only with `stream: true`, as OpenAI)."""
    opts = req.stream_options
    if opts is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")
    return bool(opts.include_usage)


class ChatRender:
    def __init__(self, state, model_id: str, usage_chunk: bool = False):
        self.state = state
        self.usage_chunk = usage_chunk
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model_id
        self.n_tools = 0
        self.custom = frozenset()     # the request's custom tools' names

    def _chunk(self, delta: dict, finish=None, **extra) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                  "finish_reason": finish}
        return sse.data({"id": self.id, "object": "chat.completion.chunk",
                         "created": self.created, "model": self.model,
                         "system_fingerprint": None, "choices": [choice], **extra})

    def head(self) -> bytes:
        # the hot path (a content delta without logprobs) is a pre-rendered template
        pre = self._chunk({"content": "\x00"}).decode()
        a, b = pre.split(sse.dumps("\x00"))
        self._pre, self._post = a.encode(), b.encode()
        return self._chunk({"role": "assistant", "content": ""})

    def _content(self, text: str) -> bytes:
        return self._pre + sse.dumps(text).encode() + self._post

    def feed(self, batch: list) -> bytes:
        out = []
        text, lps = [], []

        def flush():
            if text:
                if lps:
                    lp = {"content": logprob_entries(self.state, lps)}
                    out.append(self._chunk({"content": "".join(text)}, logprobs=lp))
                else:
                    out.append(self._content("".join(text)))
                text.clear()
                lps.clear()

        for ev in batch:
            if isinstance(ev, Text):
                text.append(ev.text)
                lps.extend(ev.logprobs)
            elif isinstance(ev, Reasoning):
                flush()
                out.append(self._chunk(reasoning_fields(ev.text)))
            elif isinstance(ev, Tool):
                flush()
                out.append(self._chunk({"tool_calls": [tool_call_json(ev.call, self.n_tools,
                                                                      self.custom)]}))
                self.n_tools += 1
            elif isinstance(ev, Done):
                flush()
                if self.usage_chunk:     # OpenAI's shape: usage alone, after the finish chunk
                    out.append(self._chunk({}, FINISH[ev.finish_reason]))
                    out.append(sse.data({"id": self.id, "object": "chat.completion.chunk",
                                         "created": self.created, "model": self.model,
                                         "system_fingerprint": None, "choices": [],
                                         "usage": usage(ev)}))
                else:
                    out.append(self._chunk({}, FINISH[ev.finish_reason], usage=usage(ev)))
                out.append(sse.DONE)
        flush()
        return b"".join(out)

    def result(self, done: Done, want_logprobs: bool) -> dict:
        msg = {"role": "assistant", "content": done.text}
        if done.reasoning:
            msg.update(reasoning_fields(done.reasoning))
        if done.tool_calls:
            msg["tool_calls"] = [tool_call_json(c, None, self.custom) for c in done.tool_calls]
        choice = {"index": 0, "message": msg, "logprobs": None,
                  "finish_reason": FINISH[done.finish_reason]}
        if want_logprobs:
            choice["logprobs"] = {"content": logprob_entries(self.state, done.logprobs)}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": [choice],
                "usage": usage(done)}


def _openai_error_frame(e: APIError) -> bytes:
    return sse.data(openai_body(e)) + sse.DONE


async def chat_completions(request: Request, validated: ChatCompletionRequest):
    state = await state_for(request, validated.model)
    call = parse_chat(validated, state)
    stream = bool(validated.stream)
    usage_chunk = include_usage(validated, stream)
    gen = await start(state, call, request)
    render = ChatRender(state, state.model_id, usage_chunk)
    render.custom = custom_names(plain(validated.tools))
    if stream:
        return chat_stream(gen, render, render.head(), _openai_error_frame)
    done = await complete(gen)
    return JSONResponse(render.result(done, call.logprobs or call.top_logprobs > 0))


# --- /v1/completions --------------------------------------------------------------


def parse_completion(req: CompletionRequest, state) -> Call:
    """The `Call` of a validated completion request."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [int(t) for t in prompt]
    elif prompt is None:
        raise bad_request("prompt required", param="prompt")
    else:
        raise bad_request("prompt must be a string or an array of token ids (one prompt)",
                          param="prompt")
    _single_choice(req)
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    call = Call(prompt=prompt)
    apply_constraints(call, req.response_format, None, None)
    call.max_tokens = req.max_tokens
    sampling_from(req, call, state)
    call.stop = stop_list(req.stop)
    lp = req.logprobs
    if isinstance(lp, bool):
        call.logprobs, call.top_logprobs = lp, 0
    else:
        call.top_logprobs = _logprobs_count(lp)
        call.logprobs = lp is not None
    return call


def _logprobs_count(v) -> int:
    """Completions' `logprobs: N` (0-20; its several shapes are checked here)."""
    if v is None:
        return 0
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise bad_request(f"logprobs must be an integer, got {json.dumps(v)}", param="logprobs")
    if not 0 <= v <= 20:
        raise bad_request(f"logprobs must be {'>= 0' if v < 0 else '<= 20'}, got {v}",
                          param="logprobs")
    return v


def completion_logprobs(state, lps: list, before: Optional[list] = None,
                        text: Optional[str] = None) -> dict:
    """The completions API's logprobs of tokens `lps`, after the answer's tokens `before`
    (a stream's earlier chunks; extended in place). A token's `text_offset` is the length of
    the text its earlier tokens decode to, in context, less what the answer's `text` (all of
    it so far) leaves out at its start (a detokenizer drops the first token's leading space):
    offsets then index `text`, and do not depend on how a stream is cut into chunks (a
    speculating row sends several tokens a chunk)."""
    tok = state.tokenizer
    tokens, token_lps, tops, offsets = [], [], [], []
    ids = before if before is not None else []
    lead = 0
    if text is not None:
        whole = tok.decode(ids + [e["token"] for e in lps])
        if len(whole) > len(text) and whole.endswith(text):
            lead = len(whole) - len(text)
    for e in lps:
        t = tok.decode([e["token"]])
        tokens.append(t)
        token_lps.append(finite(e["logprob"]))
        offsets.append(max(0, len(tok.decode(ids)) - lead) if ids else 0)
        ids.append(e["token"])
        top = e.get("top")
        tops.append({tok.decode([i]): finite(lp) for i, lp in top} if top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


class CompletionRender:
    def __init__(self, state, model_id: str, want_logprobs: bool, usage_chunk: bool = False):
        self.state = state
        self.usage_chunk = usage_chunk
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model_id
        self.want_logprobs = want_logprobs
        self.offset = 0
        self.ids: list = []         # (the tokens streamed so far: their text offsets)
        self.text = ""              # (and their text, with logprobs)
        self._pre = self._post = None

    def _chunk(self, text: str, finish=None, logprobs=None, **extra) -> bytes:
        return sse.data({"id": self.id, "object": "text_completion", "created": self.created,
                         "model": self.model, "choices": [{"index": 0, "text": text,
                                                           "logprobs": logprobs,
                                                           "finish_reason": finish}], **extra})

    def feed(self, batch: list) -> bytes:
        out = []
        text, lps = [], []
        for ev in batch:
            if isinstance(ev, Text):
                text.append(ev.text)
                lps.extend(ev.logprobs)
            elif isinstance(ev, Done):
                if text:
                    out.append(self._emit(text, lps))
                    text, lps = [], []
                if self.usage_chunk:
                    out.append(self._chunk("", FINISH[ev.finish_reason]))
                    out.append(sse.data({"id": self.id, "object": "text_completion",
                                         "created": self.created, "model": self.model,
                                         "choices": [], "usage": usage(ev)}))
                else:
                    out.append(self._chunk("", FINISH[ev.finish_reason], usage=usage(ev)))
                out.append(sse.DONE)
        if text:
            out.append(self._emit(text, lps))
        return b"".join(out)

    def _emit(self, text, lps) -> bytes:
        t = "".join(text)
        if self.want_logprobs:
            self.text += t
            lp = completion_logprobs(self.state, lps, self.ids, self.text)
            self.offset += len(t)
            return self._chunk(t, logprobs=lp)
        self.offset += len(t)
        if self._pre is None:
            a, b = self._chunk("\x00").decode().split(sse.dumps("\x00"))
            self._pre, self._post = a.encode(), b.encode()
        return self._pre + sse.dumps(t).encode() + self._post

    def result(self, done: Done) -> dict:
        lp = (completion_logprobs(self.state, done.logprobs, text=done.text)
              if self.want_logprobs else None)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "text": done.text, "logprobs": lp,
                             "finish_reason": FINISH[done.finish_reason]}],
                "usage": usage(done)}


async def completions(request: Request, validated: CompletionRequest):
    state = await state_for(request, validated.model)
    call = parse_completion(validated, state)
    stream = bool(validated.stream)
    usage_chunk = include_usage(validated, stream)
    gen = await start(state, call, request)
    render = CompletionRender(state, state.model_id, call.logprobs, usage_chunk)
    if stream:
        return chat_stream(gen, render, b"", _openai_error_frame)
    done = await complete(gen)
    return JSONResponse(render.result(done))
