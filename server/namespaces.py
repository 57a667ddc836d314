"""Namespace tools (OpenAI Responses): a group of tools under one name.

Codex CLI sends every MCP server's tools (and its sub-agent tools, `multi_agent_v1`) this way,
to any Responses provider, a local one included (0.171.0: `{"type": "namespace", "name":
"mcp__demo", "description": "Tools in the mcp__demo namespace.", "tools": [{"type": "function",
"name": "echo", "parameters": {...}, "strict": false}]}`; other builds name it `mcp__demo__`,
and tools may carry `defer_loading` or be `custom`), and expects a call of one of them back as
`{"type": "function_call", "namespace": "mcp__demo", "name": "echo", ...}` (or a
`custom_tool_call` with its `namespace`); it sends that item back verbatim as history. Dropped,
the model never sees the tools; flattened without the namespace, Codex cannot route the call.

Chat templates know flat functions only, so each tool of a namespace reaches the model as one
function named `joined(namespace, name)`: the namespace and the name, with `__` between them
unless the namespace already ends in `_` (`mcp__demo` or `mcp__demo__` + `echo` is
`mcp__demo__echo`, the name MCP tools go by elsewhere). The call the model makes comes
back split into its namespace and name, and a history item's call is shown joined again (a pure
function of the two, so history needs no table). The default namespace (`functions`, or none)
is no namespace: its tools keep their names.
"""

from __future__ import annotations

from .errors import bad_request

DEFAULT = ("", "functions")


def joined(namespace, name: str) -> str:
    """The name the model sees for tool `name` of `namespace`."""
    if not namespace or namespace in DEFAULT:
        return name
    return namespace + name if namespace.endswith("_") else f"{namespace}__{name}"


def expand(tools, where: str = "tools"):
    """(the request's tools with every namespace tool replaced by its tools under their
    joined names, {joined name: (namespace or None for the default one, name)} of those,
    where each of the tools is in the request: `tools[i]` or `tools[i].tools[j]`, for
    errors). Anything else is left to the tools' own checks."""
    if not isinstance(tools, list):
        return tools, {}, None
    out, spaces, labels = [], {}, []
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "namespace"):
            out.append(t)
            labels.append(f"{where}[{i}]")
            continue
        ns, inner, desc = t.get("name"), t.get("tools"), t.get("description")
        if not isinstance(ns, str) or not ns:
            raise bad_request(f"{where}[{i}]: a namespace needs a name", param=where)
        if not isinstance(inner, list):
            raise bad_request(f"{where}[{i}].tools must be an array", param=where)
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}[{i}].description must be a string", param=where)
        for j, tool in enumerate(inner):
            at = f"{where}[{i}].tools[{j}]"
            if not isinstance(tool, dict) or tool.get("type", "function") not in ("function",
                                                                                  "custom"):
                raise bad_request(f"{at} must be a function or custom tool", param=where)
            name, own = tool.get("name"), tool.get("description")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{at} needs a name", param=where)
            if own is not None and not isinstance(own, str):
                raise bad_request(f"{at}.description must be a string", param=where)
            full = joined(ns, name)
            spaces[full] = (None if ns in DEFAULT else ns, name)
            out.append({**tool, "name": full, "description": _described(desc, own)})
            labels.append(at)
    return out, spaces, labels


def _described(space, own):
    """A namespaced tool's description: the namespace's, unless it says nothing more than
    Codex's default ("Tools in the X namespace."), then the tool's own."""
    if isinstance(space, str) and space.strip() and not (
            space.startswith("Tools in the ") and space.endswith(" namespace.")):
        return f"{space.strip()}\n\n{own}" if isinstance(own, str) and own else space.strip()
    return own


def split(spaces: dict, name: str) -> dict:
    """The fields an output item names a called tool by: `{"name"}`, plus `{"namespace"}`
    for a namespace's tool."""
    ns, own = spaces.get(name, (None, name))
    return {"name": own} if ns is None else {"namespace": ns, "name": own}


def choice(value, where: str = "tool_choice"):
    """A `tool_choice` naming a namespace's tool (`{"type": "function" or "custom", "name",
    "namespace"}`) as the choice of its joined name; any other as it is. A namespace that is
    not a string (nor null) is a 400."""
    if not isinstance(value, dict) or value.get("namespace") is None:
        return value
    if not isinstance(value["namespace"], str):
        raise bad_request(f"{where}.namespace must be a string", param=where)
    if not isinstance(value.get("name"), str):
        return value
    return {**{k: v for k, v in value.items() if k != "namespace"},
            "name": joined(value["namespace"], value["name"])}


def sent_tools(sent) -> list:
    """The namespace tools among the tools as sent (echoed in the response object)."""
    return [t for t in sent or () if isinstance(t, dict) and t.get("type") == "namespace"]
