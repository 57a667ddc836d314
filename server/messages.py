"""Request messages and tools, normalized for the chat template (shared by the
three protocol modules): OpenAI chat messages and tool calls, function tools in
their nested or flat shapes, text content parts, stop strings and logit bias. They read
the validated request model's values (`server.schemas`: a message's content and the
tools keep the shape the client sent, checked here). Client mistakes are `APIError`s
(400)."""

from __future__ import annotations

import json
from typing import Any, Optional

from .custom_tools import as_function, custom_call
from .errors import bad_request
from .images import IMAGE_TYPES, image_part

ROLES = ("system", "user", "assistant", "tool", "developer")


def text_content(content: Any, where: str, text_types=("text", "input_text", "output_text"),
                 param: str = "messages") -> str:
    """A message `content` (string, null or a list of text parts) as one string; a bad one is
    a 400 naming `param` (the request field it came from)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
                continue
            if not isinstance(p, dict):
                raise bad_request(f"{where}: content parts must be objects", param=param)
            t = p.get("type")
            if t in text_types:
                text = p.get("text")
                if not isinstance(text, str):
                    raise bad_request(f"{where}: a {t} part needs a string 'text'", param=param)
                parts.append(text)
            elif t in IMAGE_TYPES:       # (its marker; the image goes to `images.collect`)
                parts.append(image_part(p, where))
            elif t in ("input_audio", "file", "input_file"):
                raise bad_request(f"{where}: {t} content is not supported: this server has no "
                                  "audio/file sidecar", param=param)
            else:
                raise bad_request(f"{where}: unknown content part type {t!r}", param=param)
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or an array of parts", param=param)


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
        if hasattr(tc, "model_dump"):           # a validated ToolCall: the fields sent
            tc = tc.model_dump(exclude_unset=True)
        if not isinstance(tc, dict):
            raise bad_request(f"{where}: tool_calls[{j}] must be an object")
        if tc.get("type") == "custom":      # a custom tool's call: {custom: {name, input}}
            out.append(custom_call(tc, j, where))
            continue
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
        msg = {"role": role, "content": text_content(m.get("content"), where)}
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


def normalize_tools(tools, where: str = "tools", labels=None) -> Optional[list]:
    """OpenAI function tools (nested or flat) and custom tools (server.custom_tools: a function
    of one string); built-in tool types dropped. `labels`: where each tool is in the request
    (errors name it; default ``where[i]``)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"{where} must be an array", param=where)
    out, at_out = [], []
    for i, t in enumerate(tools):
        at = labels[i] if labels is not None else f"{where}[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{at} must be an object", param=where)
        typ = t.get("type", "function")
        if typ is not None and not isinstance(typ, str):
            raise bad_request(f"{at}.type must be a string", param=where)
        if typ not in ("function", "custom", None):
            continue  # built-in / server tools (web_search, ...) are dropped
        if typ == "custom":                 # free text in, one string parameter to the model
            out.append(as_function(t, at, where))
            at_out.append(at)
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{at} needs a non-empty function name", param=where)
        params = fn.get("parameters", fn.get("input_schema"))
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"{at}.parameters must be an object", param=where)
        if fn is not t and "parameters" in fn:
            out.append({"type": "function", "function": fn})   # as sent (key order kept)
            at_out.append(at)
            continue
        f = {"name": name}
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{at}.description must be a string", param=where)
        if desc is not None:
            f["description"] = desc
        f["parameters"] = params
        out.append({"type": "function", "function": f})
        at_out.append(at)
    check_tools(out, where, at_out)
    return out or None


def plain(value):
    """A validated request value as the JSON the client sent: a nested request model as
    the dict of the fields it set (extras included), lists item by item."""
    from pydantic import BaseModel
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def shallow(items: list) -> list:
    """Validated messages as dicts of their fields (unset ones None, extras included;
    nested models and content left as validated): what the message normalizers read."""
    return [{**vars(m), **(m.model_extra or {})} for m in items]


def stop_list(value) -> list:
    """A validated stop string or list of them (`StringOrStrings`), empty strings dropped."""
    if value is None:
        return []
    return [s for s in ([value] if isinstance(value, str) else value) if s]


def check_logit_bias(bias: Optional[dict], vocab_size: int,
                     key: str = "logit_bias") -> Optional[dict]:
    """A validated `{str: float}` logit bias as `{token id: bias}`; a key that is not an
    id in the vocabulary is a 400 naming the field."""
    if not bias:
        return None
    out = {}
    for k, b in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"{key} must be a dict of int to float (bad key {k!r})",
                              param=key) from None
        if not 0 <= tid < vocab_size:
            raise bad_request(f"{key}: token id {tid} is outside the vocabulary "
                              f"(size {vocab_size})", param=key)
        out[tid] = float(b)
    return out


def check_tools(tools: list, where: str = "tools", labels=None) -> None:
    """Tool names as OpenAI requires them (``^[a-zA-Z0-9_-]{1,64}$``, each once): a 400
    naming the field otherwise (their schemas: `constraints.check_tool_schemas`)."""
    from engine import check_tool_names

    try:
        check_tool_names([t["function"]["name"] for t in tools], where, labels)
    except ValueError as e:
        raise bad_request(str(e), param=where) from None
