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
    joined names, {joined name: (namespace, name)}). Anything else is left to the tools'
    own checks."""
    if not isinstance(tools, list):
        return tools, {}
    out, spaces = [], {}
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "namespace"):
            out.append(t)
            continue
        ns, inner, desc = t.get("name"), t.get("tools"), t.get("description")
        if not isinstance(ns, str) or not ns:
            raise bad_request(f"{where}[{i}]: a namespace needs a name", param=where)
        if not isinstance(inner, list):
            raise bad_request(f"{where}[{i}].tools must be an array", param=where)
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}[{i}].description must be a string", param=where)
        for j, tool in enumerate(inner):
            if not isinstance(tool, dict) or tool.get("type", "function") not in ("function",
                                                                                  "custom"):
                raise bad_request(f"{where}[{i}].tools[{j}] must be a function or custom tool",
                                  param=where)
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}[{i}].tools[{j}] needs a name", param=where)
            full = joined(ns, name)
            spaces[full] = (None if ns in DEFAULT else ns, name)
            out.append({**tool, "name": full,
                        "description": _described(desc, tool.get("description"))})
    return out, {k: v for k, v in spaces.items() if v[0] is not None}


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
    if name in spaces:
        ns, own = spaces[name]
        return {"namespace": ns, "name": own}
    return {"name": name}


def choice(value):
    """A `tool_choice` naming a namespace's tool (`{"type": "function", "name", "namespace"}`)
    as the choice of its joined name; any other as it is."""
    if isinstance(value, dict) and isinstance(value.get("namespace"), str) and isinstance(
            value.get("name"), str):
        return {**{k: v for k, v in value.items() if k != "namespace"},
                "name": joined(value["namespace"], value["name"])}
    return value


def sent_tools(sent) -> list:
    """The namespace tools among the tools as sent (echoed in the response object)."""
    return [t for t in sent or () if isinstance(t, dict) and t.get("type") == "namespace"]
