"""OpenAI Responses: `POST /v1/responses`.

Request: `input` (a string or items: `message`, `function_call`,
`function_call_output`; `reasoning` items are dropped), `instructions`
(merged with any system/developer items into one leading system message),
`max_output_tokens`, sampling fields, flat function `tools` (built-in tool
types dropped), `tool_choice`, `stream`, `store`, and
`previous_response_id`: the stored input + output of that response are
spliced in front of this input (instructions carry forward when omitted).
The store is per process (1 h TTL, 32 MiB byte-capped LRU, `/stats`
`response_store`); an unknown or expired id is a 404.

Response: `{id: "resp_<24 hex>", object: "response", status: "completed" |
"incomplete", output: [reasoning | message | function_call items], usage}`.
A thinking model's reasoning is a `reasoning` item (`content: [{type:
"reasoning_text", text}]`) before the message.

Streaming: response.created -> response.in_progress ->
response.output_item.added -> response.content_part.added ->
response.output_text.delta* -> response.output_text.done ->
response.content_part.done -> response.output_item.done (a function_call item:
output_item.added -> function_call_arguments.delta -> .done ->
output_item.done; a reasoning item: output_item.added -> content_part.added ->
reasoning_text.delta* -> reasoning_text.done -> content_part.done ->
output_item.done) -> response.completed (response.incomplete, status
"incomplete", when the token limit stopped it).
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import custom_tools, namespaces, sse
from .call import Call, sampling_from, template_kwargs_from
from .chat import Done, Reasoning, Text, Tool, complete, start
from .images import MARK, collect
from .messages import normalize_tools, parse_arguments, stop_list, text_content
from .chat import stream as chat_stream
from .constraints import apply_constraints
from .models_lease import state_for
from .errors import APIError, bad_request, not_found, openai_body
from .schemas.responses import ResponsesRequest


def _hex(n: int) -> str:
    return uuid.uuid4().hex[:n]


def _part_text(content, where: str) -> str:
    return text_content(content, where, text_types=("input_text", "output_text", "text",
                                                      "refusal"), param="input")


def normalize_input(inp) -> list:
    """Input items in canonical JSON form (what the store keeps)."""
    if isinstance(inp, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": inp}]}]
    if inp is None:
        raise bad_request("input required", param="input")
    if not isinstance(inp, list):
        raise bad_request("input must be a string or an array of items", param="input")
    out = []
    for i, it in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request(f"{where} must be an object", param="input")
        t = it.get("type") or ("message" if "role" in it else None)
        if t == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer",
                                  param="input")
            text = _part_text(it.get("content"), where)
            kind = "output_text" if role == "assistant" else "input_text"
            out.append({"type": "message", "role": role,
                        "content": [{"type": kind, "text": text}]})
        elif t == "function_call":
            name = it.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}: function_call needs a name", param="input")
            args = it.get("arguments", "{}")
            if not isinstance(args, str):
                raise bad_request(f"{where}: function_call arguments must be a JSON string",
                                  param="input")
            out.append({"type": "function_call", "call_id": str(it.get("call_id") or
                                                                 it.get("id") or ""),
                        "name": name, "arguments": args,
                        **_space(it, where)})
        elif t == "custom_tool_call":
            out.append({**custom_tools.input_item(it, where), **_space(it, where)})
        elif t in ("function_call_output", "custom_tool_call_output"):
            output = it.get("output")
            if not isinstance(output, str):
                output = _part_text(output, where)
            out.append({"type": "function_call_output", "call_id": str(it.get("call_id", "")),
                        "output": output})
        elif t == "reasoning":
            continue
        else:
            raise bad_request(f"{where}: unsupported input item type {t!r}", param="input")
    return out


def items_to_messages(items: list, instructions) -> list:
    system = [instructions] if instructions else []
    msgs: list = []
    for it in items:
        t = it["type"]
        if t == "message":
            text = "".join(p["text"] for p in it["content"])
            if it["role"] in ("system", "developer"):
                system.append(text)
            else:
                msgs.append({"role": it["role"], "content": text})
        elif t in ("function_call", "custom_tool_call"):
            name = namespaces.joined(it.get("namespace"), it["name"])
            call = (custom_tools.as_call({**it, "name": name}) if t == "custom_tool_call" else
                    {"id": it["call_id"], "type": "function",
                     "function": {"name": name,
                                  "arguments": parse_arguments(it["arguments"])}})
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif t == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    if system:
        msgs.insert(0, {"role": "system", "content": "\n\n".join(system)})
    if not msgs:
        raise bad_request("input has no messages", param="input")
    return msgs


def _space(it: dict, where: str) -> dict:
    """A history call item's namespace (`{}` without one), checked."""
    ns = it.get("namespace")
    if ns is None:
        return {}
    if not isinstance(ns, str):
        raise bad_request(f"{where}: namespace must be a string", param="input")
    return {"namespace": ns}


def flat_tools(tools, sent=None, spaces=None):
    """The response object's `tools`: function tools flat, custom and namespace tools as
    `sent` (a namespace's tools, under their joined names in `spaces`, once, as the group)."""
    if not tools:
        return []
    custom = {t["name"]: t for t in sent or () if isinstance(t, dict)
              and t.get("type") == "custom" and isinstance(t.get("name"), str)}
    spaces = spaces or {}
    return [custom.get(t["function"]["name"]) or
            {"type": "function", "name": t["function"]["name"],
             "description": t["function"].get("description"),
             "parameters": t["function"]["parameters"], "strict": False} for t in tools
            if t["function"]["name"] not in spaces] + namespaces.sent_tools(sent)


class ResponseRender:
    def __init__(self, state, streaming: bool, meta: dict):
        self.state = state
        self.streaming = streaming
        self.id = "resp_" + _hex(24)
        self.created = int(time.time())
        self.meta = meta
        self.items: list = []
        self._open = None   # output index of the open message item
        self.seq = 0
        self.custom = frozenset()   # the request's custom tools' names (custom_tool_call items)
        self.spaces: dict = {}      # joined name -> (namespace, name): server.namespaces

    def _ev(self, name, obj) -> bytes:
        if not self.streaming:
            return b""
        frame = sse.event(name, {"type": name, "sequence_number": self.seq, **obj})
        self.seq += 1
        return frame

    def snapshot(self, status: str, done: Done = None) -> dict:
        r = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
             "error": None, "incomplete_details": None, "model": self.state.model_id,
             "output": self.items if done is not None else [], "parallel_tool_calls": True,
             "reasoning": {"effort": None, "summary": None}, "text": {"format": {"type": "text"}},
             "truncation": "disabled", "user": None, "metadata": {}, "usage": None, **self.meta}
        if done is not None:
            r["usage"] = {"input_tokens": done.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": done.cached_tokens},
                          "output_tokens": done.completion_tokens,
                          "output_tokens_details": {"reasoning_tokens":
                                                                done.reasoning_tokens},
                          "total_tokens": done.prompt_tokens + done.completion_tokens}
            if status == "incomplete":
                r["incomplete_details"] = {"reason": "max_output_tokens"}
        return r

    def head(self) -> bytes:
        snap = self.snapshot("in_progress")
        return self._ev("response.created", {"response": snap}) + self._ev(
            "response.in_progress", {"response": snap})

    def _open_item(self, kind: str) -> bytes:
        """Open a `message` (output_text part) or `reasoning` (reasoning_text part) item."""
        i = len(self.items)
        self._open = i
        if kind == "reasoning":
            item = {"id": "rs_" + _hex(24), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": "msg_" + _hex(24), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        self.items.append(item)
        item["content"].append(dict(part))
        return self._ev("response.output_item.added", {
            "output_index": i, "item": {**item, "content": []}}) + self._ev(
            "response.content_part.added", {"item_id": item["id"], "output_index": i,
                                            "content_index": 0, "part": part})

    def _close(self, status: str = "completed") -> bytes:
        """Close the open item: `completed`, or `incomplete` when the token limit cut it."""
        if self._open is None:
            return b""
        i, self._open = self._open, None
        item = self.items[i]
        item["status"] = status
        part = item["content"][0]
        ref = {"item_id": item["id"], "output_index": i, "content_index": 0}
        done = (self._ev("response.reasoning_text.done", {**ref, "text": part["text"]})
                if item["type"] == "reasoning" else
                self._ev("response.output_text.done", {**ref, "text": part["text"],
                                                       "logprobs": []}))
        return (done + self._ev("response.content_part.done", {**ref, "part": part})
                + self._ev("response.output_item.done", {"output_index": i, "item": item}))

    def _append(self, ev) -> bytes:
        kind = "reasoning" if isinstance(ev, Reasoning) else "message"
        out = b""
        if self._open is not None and self.items[self._open]["type"] != kind:
            out += self._close()
        if self._open is None:
            out += self._open_item(kind)
        item = self.items[self._open]
        item["content"][0]["text"] += ev.text
        ref = {"item_id": item["id"], "output_index": self._open, "content_index": 0}
        if kind == "reasoning":
            return out + self._ev("response.reasoning_text.delta", {**ref, "delta": ev.text})
        return out + self._ev("response.output_text.delta", {**ref, "delta": ev.text,
                                                             "logprobs": []})

    def _custom_call(self, c) -> bytes:
        """A custom tool's call: a `custom_tool_call` item, its input streamed whole."""
        i = len(self.items)
        item = {**custom_tools.output_item(c, "ctc_" + _hex(24), "in_progress"),
                **namespaces.split(self.spaces, c.name)}
        text, item["input"] = item["input"], ""
        self.items.append(item)
        ref = {"item_id": item["id"], "output_index": i}
        out = self._ev("response.output_item.added", {"output_index": i, "item": dict(item)})
        out += self._ev("response.custom_tool_call_input.delta", {**ref, "delta": text})
        item["input"], item["status"] = text, "incomplete" if c.cut else "completed"
        out += self._ev("response.custom_tool_call_input.done", {**ref, "input": text})
        return out + self._ev("response.output_item.done", {"output_index": i, "item": item})

    def feed(self, batch: list) -> bytes:
        out = []
        for ev in batch:
            if isinstance(ev, (Text, Reasoning)):
                if ev.text:
                    out.append(self._append(ev))
            elif isinstance(ev, Tool) and ev.call.name in self.custom:
                out.append(self._close())
                out.append(self._custom_call(ev.call))
            elif isinstance(ev, Tool):
                out.append(self._close())
                c = ev.call
                i = len(self.items)
                item = {"id": "fc_" + _hex(24), "type": "function_call", "status": "in_progress",
                        "arguments": "", "call_id": c.id,
                        **namespaces.split(self.spaces, c.name)}
                self.items.append(item)
                out.append(self._ev("response.output_item.added",
                                    {"output_index": i, "item": dict(item)}))
                out.append(self._ev("response.function_call_arguments.delta", {
                    "item_id": item["id"], "output_index": i, "delta": c.arguments_json}))
                item["arguments"] = c.arguments_json
                item["status"] = "incomplete" if c.cut else "completed"
                out.append(self._ev("response.function_call_arguments.done", {
                    "item_id": item["id"], "output_index": i, "name": item["name"],
                    "arguments": c.arguments_json}))
                out.append(self._ev("response.output_item.done", {"output_index": i,
                                                                  "item": item}))
            elif isinstance(ev, Done):
                cut = ev.finish_reason == "length"
                # (an answer with no message gets an empty one, but not reasoning the token
                # limit cut: that item, incomplete, is the answer so far)
                if not any(it["type"] != "reasoning" for it in self.items) and not (
                        cut and self.items):
                    out.append(self._close())
                    out.append(self._open_item("message"))
                out.append(self._close("incomplete" if cut else "completed"))
                self.done = ev
                self.final = self.result(ev)    # the non-streamed body and the stored object
                self.on_done(ev)
                status = self.status(ev)      # a token-limit stop ends response.incomplete
                out.append(self._ev("response.incomplete" if status == "incomplete"
                                    else "response.completed",
                                    {"response": self.snapshot(status, ev)}))
        return b"".join(out)

    def on_done(self, done: Done) -> None:  # replaced by the route (store)
        pass

    @staticmethod
    def status(done: Done) -> str:
        return "incomplete" if done.finish_reason == "length" else "completed"

    def result(self, done: Done) -> dict:
        r = self.snapshot(self.status(done), done)
        r["output_text"] = "".join(p["text"] for it in self.items if it["type"] == "message"
                                   for p in it["content"])
        return r


def parse_responses(req: ResponsesRequest, state):
    """(Call, conversation items, instructions, echoed fields, (its custom tools' names, its
    namespaces' tools: `namespaces.expand`)) of a validated request."""
    prev_id = req.previous_response_id
    instructions = req.instructions
    with collect(state) as images:     # (the input's image parts: MARKs in its text)
        items = normalize_input(req.input)
    history: list = []
    if prev_id:
        prior = state.store.get(prev_id)
        if prior is None:
            raise not_found(f"no stored response with id {prev_id!r} (unknown or expired)")
        history = prior["input"] + [_as_input(o) for o in prior["output"]]
        if instructions is None:
            instructions = prior["instructions"]
    conversation = history + items
    if any(MARK in str(h) for h in history):
        raise bad_request("previous_response_id: that conversation had images, which are not "
                          "stored; send its input again with the images")
    call = Call(messages=items_to_messages(conversation, instructions))
    call.images = images
    call.max_tokens = req.max_output_tokens
    sampling_from(req, call, state)
    call.stop = stop_list(req.stop)
    sent, spaces, labels = namespaces.expand(req.tools)
    tools = normalize_tools(sent, labels=labels)
    choice = req.tool_choice
    apply_constraints(call, req.text.format if req.text is not None else None,
                      custom_tools.function_choice(namespaces.choice(choice)),
                      tools, format_param="text.format",
                      parallel=req.parallel_tool_calls is not False)
    call.tools = None if choice == "none" else tools
    call.template_kwargs = template_kwargs_from(req, state)
    if req.reasoning is not None and isinstance(req.reasoning.effort, str):
        call.template_kwargs["enable_thinking"] = req.reasoning.effort.lower() != "none"
    meta = {"instructions": instructions, "max_output_tokens": call.max_tokens,
            "previous_response_id": prev_id, "store": req.store is not False,
            "temperature": call.temperature, "top_p": call.top_p,
            "tool_choice": choice if isinstance(choice, (str, dict)) else "auto",
            "tools": flat_tools(tools, req.tools, spaces),
            # (echoed as sent: a client checks its own metadata and settings in the object)
            "metadata": req.metadata or {}, "user": req.user,
            "parallel_tool_calls": req.parallel_tool_calls is not False}
    return call, conversation, instructions, meta, (custom_tools.custom_names(sent), spaces)


def _as_input(item: dict) -> dict:
    if item["type"] == "message":
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "".join(
                    p.get("text", "") for p in item["content"])}]}
    ns = {"namespace": item["namespace"]} if "namespace" in item else {}
    if item["type"] == "function_call":
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"], **ns}
    if item["type"] == "custom_tool_call":
        return {"type": "custom_tool_call", "call_id": item["call_id"], "name": item["name"],
                "input": item["input"], **ns}
    return item


def _error_frame(render: ResponseRender, e: APIError) -> bytes:
    snap = render.snapshot("failed")
    snap["error"] = openai_body(e)["error"]
    return render._ev("response.failed", {"response": snap}) + render._ev(
        "error", {"message": e.message, "code": e.code, "param": None})


async def create_response(request: Request, validated: ResponsesRequest):
    state = await state_for(request, validated.model)
    call, conversation, instructions, meta, (custom, spaces) = parse_responses(validated, state)
    stream = bool(validated.stream)
    gen = await start(state, call, request)
    render = ResponseRender(state, stream, meta)
    render.custom, render.spaces = custom, spaces

    def on_done(done: Done):        # (a turn whose client left is not kept)
        if meta["store"] and done.finish_reason != "cancelled":
            state.store.put(render.id, conversation, [_as_input(i) for i in render.items],
                            instructions, response=render.final)
    if stream:
        render.on_done = on_done
        return chat_stream(gen, render, render.head(), lambda e: _error_frame(render, e))
    await complete(gen, render.feed)
    answer = JSONResponse(render.final)     # stored only once the answer could be made
    on_done(render.done)
    return answer


def _stored(state, rid: str) -> dict:
    entry = state.store.get(rid)
    if entry is None or entry.get("response") is None:
        raise not_found(f"no stored response with id {rid!r} (unknown, expired, deleted or "
                        "created with store=false)")
    return entry


async def get_response(request: Request):
    """GET /v1/responses/{id}: the final response object of a stored turn."""
    state = request.app.state.server
    return JSONResponse(_stored(state, request.path_params["response_id"])["response"])


async def delete_response(request: Request):
    """DELETE /v1/responses/{id}: forget a stored turn (it can no longer be continued)."""
    state = request.app.state.server
    rid = request.path_params["response_id"]
    _stored(state, rid)
    state.store.delete(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
