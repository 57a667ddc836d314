"""Freeform (`custom`) tools: a tool whose input is one string, not JSON arguments.

OpenAI's Responses API (and chat completions) take `{"type": "custom", "name", "description",
"format": {"type": "text"} | {"type": "grammar", "syntax": "lark" | "regex", "definition"}}`
and answer with a `custom_tool_call` item (`input`: the string) instead of a `function_call`;
the next turn sends it back with a `custom_tool_call_output`. Codex CLI declares its file
editor this way (`apply_patch`, a Lark grammar of its patch format): with the tool dropped or
kept as a function of no parameters, the model never learns the input it takes and Codex never
gets the call it expects.

Chat templates know functions only, so a custom tool reaches the model as a function of one
string parameter, `input`, its description followed by the format's definition; the model's
call of it comes back as a `custom_tool_call` whose `input` is that string, and a
`custom_tool_call` of the history goes into the prompt as the same function call. The grammar
is shown to the model; a regex is also the parameter's `pattern`, which a forced call
(`tool_choice` naming the tool, or `required`) is held to; a Lark grammar is not enforced.
"""

from __future__ import annotations

import json
from .errors import bad_request

INPUT = "input"
PARAMETERS = {"type": "object", "properties": {INPUT: {"type": "string"}}, "required": [INPUT]}


def as_function(tool: dict, at: str, where: str) -> dict:
    """A custom tool (flat, or chat completions' `{"type": "custom", "custom": {...}}`) as the
    function tool the template shows (`at`: where the tool is in the request, for errors)."""
    spec = tool.get("custom", tool)
    if not isinstance(spec, dict):
        raise bad_request(f"{at}.custom must be an object", param=where)
    name, desc, fmt = spec.get("name"), spec.get("description"), spec.get("format")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{at} needs a non-empty name", param=where)
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{at}.description must be a string", param=where)
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request(f"{at}.format must be an object", param=where)
    text = desc or ""
    kind = None if fmt is None else fmt.get("type")
    if fmt is not None and kind not in ("text", "grammar"):
        raise bad_request(f"{at}.format.type must be text or grammar", param=where)
    if kind == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if syntax not in ("lark", "regex") or not isinstance(definition, str):
            raise bad_request(f"{at}.format: a grammar needs syntax lark or regex and "
                              "a definition (a string)", param=where)
        text += (f"\n\nThe `{INPUT}` argument is free text in this {syntax} grammar:\n"
                 f"{definition}")
    f = {"name": name}
    if text:
        f["description"] = text.strip()
    f["parameters"] = PARAMETERS
    if kind == "grammar" and syntax == "regex":     # (a forced call holds its input to it)
        f["parameters"] = {**PARAMETERS, "properties": {INPUT: {"type": "string",
                                                                "pattern": f"^(?:{definition})$"}}}
    return {"type": "function", "function": f}


def custom_names(tools) -> frozenset:
    """The names of the custom tools among a request's `tools` (as sent)."""
    out = set()
    for t in tools or ():
        if isinstance(t, dict) and t.get("type") == "custom":
            spec = t.get("custom") if isinstance(t.get("custom"), dict) else t
            if isinstance(spec.get("name"), str):
                out.add(spec["name"])
    return frozenset(out)


def call_input(arguments) -> str:
    """The string a custom tool's call carries: its `input` argument (or, if the model wrote
    other arguments, their JSON)."""
    if isinstance(arguments, dict) and isinstance(arguments.get(INPUT), str):
        return arguments[INPUT]
    return json.dumps(arguments, ensure_ascii=False) if arguments else ""


def input_item(it: dict, where: str) -> dict:
    """A `custom_tool_call` input item, checked."""
    name, text, cid = it.get("name"), it.get(INPUT), it.get("call_id") or it.get("id") or ""
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}: custom_tool_call needs a name", param="input")
    if not isinstance(text, str):
        raise bad_request(f"{where}: custom_tool_call needs an input (a string)", param="input")
    if not isinstance(cid, str):
        raise bad_request(f"{where}: custom_tool_call call_id must be a string", param="input")
    return {"type": "custom_tool_call", "call_id": cid, "name": name, INPUT: text}


def as_call(it: dict) -> dict:
    """A `custom_tool_call` item as the assistant's function call in the prompt."""
    return {"id": it["call_id"], "type": "function",
            "function": {"name": it["name"], "arguments": {INPUT: it[INPUT]}}}


def output_item(call, item_id: str, status: str) -> dict:
    return {"id": item_id, "type": "custom_tool_call", "status": status,
            "call_id": call.id, "name": call.name, INPUT: call_input(call.arguments)}


def function_choice(choice):
    """A `tool_choice` naming a custom tool (`{"type": "custom", "name"}`) as the function
    choice the constraints read; any other choice as it is."""
    if isinstance(choice, dict) and choice.get("type") == "custom":
        return {"type": "function", "name": choice.get("name")}
    return choice


def custom_call(tc: dict, j: int, where: str) -> dict:
    """A chat history's `{type: "custom", id, custom: {name, input}}` tool call as the
    function call the prompt shows."""
    spec = tc.get("custom")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request(f"{where}: tool_calls[{j}].custom needs a name", param="messages")
    if not isinstance(spec.get(INPUT), str):
        raise bad_request(f"{where}: tool_calls[{j}].custom.input must be a string",
                          param="messages")
    return as_call({"call_id": tc.get("id") or f"call_{j}", "name": spec["name"],
                    INPUT: spec[INPUT]})

