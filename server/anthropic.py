"""Anthropic Messages: `POST /v1/messages` (+ `/v1/messages/count_tokens`).

Request (the validated `MessagesRequest`): `system` (string or text blocks), `messages`
with string or block content; a system-role message may stand anywhere in `messages`
and is placed in the prompt where it occurs. `tool_use` blocks become the assistant's `tool_calls` and
`tool_result` blocks become `tool` messages, so tools ride the model's native
chat-template path. `tools` are `{name, description, input_schema}`;
server-tool types (web_search, bash, ...) are dropped. `max_tokens` is
required (as in the Anthropic API); `temperature`, `top_p`, `top_k` and the
engine's extra sampling fields are read from the body (the SDK sends the
latter through `extra_body`).

`thinking: {type: "enabled" | "disabled" | "adaptive", budget_tokens, display}` switches
the chat template's `enable_thinking` (adaptive: on when the template reasons; the budget
is not enforced as a separate cap: `max_tokens` bounds reasoning and answer together);
`display: "omitted"` sends thinking blocks without their text. `metadata`,
`output_config` and `context_management` are accepted and ignored.

Response: `{id: "msg_...", type: "message", role, model, content: [thinking |
text | tool_use], stop_reason: end_turn | max_tokens | stop_sequence | tool_use,
stop_sequence, usage: {input_tokens, output_tokens, cache_read_input_tokens,
cache_creation_input_tokens}}`. As in the Anthropic API, `input_tokens` counts
the prompt tokens *not* read from the prompt cache (total input =
input_tokens + cache_read_input_tokens).

Streaming: `message_start -> (content_block_start -> content_block_delta*
(thinking_delta | text_delta | input_json_delta) -> content_block_stop)* -> message_delta ->
message_stop`; an empty text block when nothing was generated; a server
fault mid-stream is an `event: error` frame.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import sse
from .call import Call, encode_async, sampling_from, template_kwargs_from
from .chat import Done, Reasoning, Text, Tool, complete, start
from .images import collect, image_part
from .messages import normalize_tools, parse_arguments, plain, shallow
from .chat import stream as chat_stream
from .constraints import apply_constraints
from .models_lease import state_for
from .errors import APIError, anthropic_body, bad_request
from .schemas.anthropic import CountTokensRequest, MessagesRequest

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
        "cancelled": "end_turn"}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id[5:] if call_id.startswith("call_") else call_id


def _blocks_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or an array of blocks")
    parts = []
    for b in content:
        if not isinstance(b, dict):
            raise bad_request(f"{where}: content blocks must be objects")
        t = b.get("type")
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise bad_request(f"{where}: a text block needs a string 'text'")
            parts.append(b["text"])
        elif t == "image":
            parts.append(image_part(b, where))
        elif t == "document":
            raise bad_request(f"{where}: document blocks are not supported")
        else:
            raise bad_request(f"{where}: unsupported block type {t!r} here")
    return "".join(parts)


def _opt(block: dict, key: str, kind: type, where: str):
    """An optional block field: its value (None when absent or null) or a 400."""
    v = block.get(key)
    if v is not None and not isinstance(v, kind):
        raise bad_request(f"{where}.{key} must be a {'string' if kind is str else 'boolean'}")
    return v


def convert_messages(system, messages) -> list:
    out = []
    if system is not None:
        out.append({"role": "system", "content": _blocks_text(system, "system")})
    if not isinstance(messages, list):
        raise bad_request("messages must be an array", param="messages")
    if not messages:
        raise bad_request("messages required: the array is empty", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system', "
                              f"got {role!r}")
        content = m.get("content")
        if role == "system":      # where it occurs (Claude Code sends them after a user turn)
            out.append({"role": "system", "content": _blocks_text(content, where)})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or an array of blocks")
        if not content and not (role == "assistant" and i == len(messages) - 1):
            raise bad_request(f"{where}: all messages must have non-empty content except for "
                              f"the optional final assistant message")   # (Anthropic's rule)
        text: list = []
        calls: list = []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            if not isinstance(b, dict):
                raise bad_request(f"{w} must be an object")
            t = b.get("type")
            if t == "text":
                if not isinstance(b.get("text"), str):
                    raise bad_request(f"{w}: a text block needs a string 'text'")
                text.append(b["text"])
            elif t in ("thinking", "redacted_thinking"):
                continue
            elif t == "tool_use":
                if role != "assistant":
                    raise bad_request(f"{w}: tool_use blocks belong to assistant messages")
                name = b.get("name")
                if not isinstance(name, str) or not name:
                    raise bad_request(f"{w}: tool_use needs a name")
                inp = b.get("input", {})
                if not isinstance(inp, (dict, str)):
                    raise bad_request(f"{w}: tool_use input must be an object")
                calls.append({"id": _opt(b, "id", str, w) or f"toolu_{i}_{j}", "type": "function",
                              "function": {"name": name, "arguments": parse_arguments(inp)}})
            elif t == "tool_result":
                if role != "user":
                    raise bad_request(f"{w}: tool_result blocks belong to user messages")
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                res = _blocks_text(b.get("content"), w)
                if _opt(b, "is_error", bool, w):
                    res = f"Error: {res}"
                out.append({"role": "tool", "tool_call_id": _opt(b, "tool_use_id", str, w) or "",
                            "content": res})
            elif t == "image":
                text.append(image_part(b, w))
            elif t == "document":
                raise bad_request(f"{w}: document blocks are not supported")
            else:
                raise bad_request(f"{w}: unknown content block type {t!r}")
        if role == "assistant":
            msg = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not content:
            out.append({"role": "user", "content": "".join(text)})
    return out


def convert_tools(tools):
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", param="tools")
    keep = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{i}] must be an object", param="tools")
        kind = t.get("type")
        if kind is not None and not isinstance(kind, str):
            raise bad_request(f"tools[{i}].type must be a string", param="tools")
        if kind not in (None, "custom"):
            continue  # server tools (web_search_*, bash_*, ...) are dropped
        schema = t.get("input_schema")
        if schema is None or schema == {}:
            schema = {"type": "object", "properties": {}}
        keep.append({"name": t.get("name"), "description": t.get("description"),
                     "parameters": schema})
    return normalize_tools(keep)


def parse_messages(req: CountTokensRequest, state) -> Call:
    """The `Call` of a validated Messages (or count_tokens) request: the model checked
    the types, ranges and enumerations (`max_tokens` is required by MessagesRequest)."""
    with collect(state) as images:
        call = Call(messages=convert_messages(req.system, shallow(req.messages)))
    call.images = images
    call.max_tokens = req.max_tokens
    sampling_from(req, call, state)
    call.stop = [s for s in req.stop_sequences or () if s]
    tools = convert_tools(req.tools)
    choice = plain(req.tool_choice)
    apply_constraints(call, None, choice, tools, parallel=not (
        choice is not None and choice.get("disable_parallel_tool_use") is True))
    if choice is not None and choice.get("type") == "none":
        tools = None
    call.tools = tools
    kw = template_kwargs_from(req, state)
    if req.thinking is not None:
        kind = req.thinking.type
        if kind != "adaptive":
            kw["enable_thinking"] = kind == "enabled"
        elif _reasons(state):
            kw["enable_thinking"] = True      # adaptive: the model thinks when it can
    call.template_kwargs = kw
    return call


def _reasons(state) -> bool:
    """Whether the model's chat template has a reasoning (thinking) format."""
    from engine import reasoning_format_for
    return reasoning_format_for(state.tokenizer) is not None


def thinking_omitted(req) -> bool:
    """`thinking.display: "omitted"`: thinking blocks carry no text."""
    return req.thinking is not None and req.thinking.display == "omitted"


def usage(prompt_tokens: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessageRender:
    """Builds the content blocks from events; SSE frames when streaming."""

    def __init__(self, model_id: str, streaming: bool, omit_thinking: bool = False):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model_id
        self.streaming = streaming
        self.omit_thinking = omit_thinking   # thinking blocks without their text
        self.blocks: list = []
        self._open = None   # index of the open text block

    def _ev(self, name, obj) -> bytes:
        return sse.event(name, {"type": name, **obj}) if self.streaming else b""

    def head(self, prompt_tokens: int, cached: int) -> bytes:
        return self._ev("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(prompt_tokens, cached, 0)}})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        i, self._open = self._open, None
        return self._ev("content_block_stop", {"index": i})

    def _append(self, ev) -> bytes:
        """Text into the open text block, reasoning into the open thinking block
        (a block of the other kind is closed first)."""
        kind, key, delta = (("thinking", "thinking", "thinking_delta") if isinstance(ev, Reasoning)
                            else ("text", "text", "text_delta"))
        out = []
        if self._open is not None and self.blocks[self._open]["type"] != kind:
            out.append(self._close())
        if self._open is None:
            self._open = len(self.blocks)
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            self.blocks.append(block)
            out.append(self._ev("content_block_start", {
                "index": self._open, "content_block": dict(block)}))
        if kind == "thinking" and self.omit_thinking:
            return b"".join(out)
        self.blocks[self._open][key] += ev.text
        out.append(self._ev("content_block_delta", {
            "index": self._open, "delta": {"type": delta, key: ev.text}}))
        return b"".join(out)

    def feed(self, batch: list) -> bytes:
        out = []
        for ev in batch:
            if isinstance(ev, (Text, Reasoning)):
                if ev.text:
                    out.append(self._append(ev))
            elif isinstance(ev, Tool):
                out.append(self._close())
                c = ev.call
                i = len(self.blocks)
                block = {"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name,
                         "input": c.arguments}
                self.blocks.append(block)
                out.append(self._ev("content_block_start", {
                    "index": i, "content_block": {**block, "input": {}}}))
                out.append(self._ev("content_block_delta", {
                    "index": i, "delta": {"type": "input_json_delta",
                                          "partial_json": c.arguments_json}}))
                out.append(self._ev("content_block_stop", {"index": i}))
            elif isinstance(ev, Done):
                out.append(self._close())
                if not self.blocks:
                    self.blocks.append({"type": "text", "text": ""})
                    out.append(self._ev("content_block_start", {
                        "index": 0, "content_block": {"type": "text", "text": ""}}))
                    out.append(self._ev("content_block_stop", {"index": 0}))
                reason, seq = self.stop(ev)
                out.append(self._ev("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)}))
                out.append(self._ev("message_stop", {}))
        return b"".join(out)

    @staticmethod
    def stop(done: Done):
        if done.finish_reason == "stop" and done.stop_string is not None:
            return "stop_sequence", done.stop_string
        return STOP[done.finish_reason], None

    def result(self, done: Done) -> dict:
        reason, seq = self.stop(done)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": reason, "stop_sequence": seq,
                "usage": usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens)}


def _error_frame(e: APIError) -> bytes:
    return sse.event("error", anthropic_body(e))


async def messages(request: Request, validated: MessagesRequest):
    state = await state_for(request, validated.model)
    call = parse_messages(validated, state)
    stream = bool(validated.stream)
    gen = await start(state, call, request)
    render = MessageRender(state.model_id, stream, thinking_omitted(validated))
    if stream:
        first = gen.first_output
        cached = first.cached_tokens if first is not None else 0
        return chat_stream(gen, render, render.head(len(gen.prompt_ids), cached), _error_frame)
    done = await complete(gen, render.feed)
    return JSONResponse(render.result(done))


async def count_tokens(request: Request, validated: CountTokensRequest):
    state = await state_for(request, validated.model)
    call = parse_messages(validated, state)
    return JSONResponse({"input_tokens": len(await encode_async(state, call))})
