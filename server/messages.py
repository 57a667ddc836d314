"""Request messages and tools, normalized for the chat template (shared by the
three protocol modules): OpenAI chat messages and tool calls, function tools in
their nested or flat shapes. Client mistakes are `APIError`s (400)."""

from __future__ import annotations

import json
from typing import Optional

from . import fields as F
from .errors import bad_request

ROLES = ("system", "user", "assistant", "tool", "developer")

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
        if typ is not None and not isinstance(typ, str):
            raise bad_request(f"{where}[{i}].type must be a string", param=where)
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
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}[{i}].description must be a string", param=where)
        if desc is not None:
            f["description"] = desc
        f["parameters"] = params
        out.append({"type": "function", "function": f})
    check_tools(out, where)
    return out or None


def check_tools(tools: list, where: str = "tools") -> None:
    """Tool names as OpenAI requires them (``^[a-zA-Z0-9_-]{1,64}$``, each once): a 400
    naming the field otherwise (their schemas: `constraints.check_tool_schemas`)."""
    from engine.constrained.checks import check_tool_names

    try:
        check_tool_names([t["function"]["name"] for t in tools], where)
    except ValueError as e:
        raise bad_request(str(e), param=where) from None
