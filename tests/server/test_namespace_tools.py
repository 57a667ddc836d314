"""Namespace tools on /v1/responses (how Codex CLI sends every MCP server's tools, to local
providers too): each tool of a namespace reaches the model as a function under its joined
name (`mcp__github__` + `create_issue`: `mcp__github__create_issue`); the model's call comes
back as a `function_call` (or `custom_tool_call`) item split into `namespace` and `name`, the
shape Codex routes by; such items are taken back as history. Before: namespace tools were
dropped (the model never saw them) and a `namespace` on a history item was ignored."""

import json

import httpx

from server import namespaces
from server.messages import normalize_tools
from server.responses import items_to_messages, normalize_input
from srv_helpers import sse_events

ISSUE = {"type": "function", "name": "create_issue", "description": "Open an issue.",
         "strict": False, "defer_loading": True,
         "parameters": {"type": "object", "properties": {"title": {"type": "string"}},
                        "required": ["title"]}}
NOTE = {"type": "custom", "name": "note", "description": "Write a note.",
        "format": {"type": "text"}}
GITHUB = {"type": "namespace", "name": "mcp__github__",
          "description": "Tools for working with GitHub.", "tools": [ISSUE, NOTE]}
CLOCK = {"type": "namespace", "name": "clock", "description": "Tools in the clock namespace.",
         "tools": [{"type": "function", "name": "now", "parameters": {"type": "object"}}]}
SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


def markup(name, args):
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": args}) + '\n</tool_call>'


def test_a_namespace_is_its_tools_under_joined_names():
    sent, spaces, labels = namespaces.expand([SHELL, GITHUB, CLOCK])
    assert labels == ["tools[0]", "tools[1].tools[0]", "tools[1].tools[1]", "tools[2].tools[0]"]
    fns = {t["function"]["name"]: t["function"] for t in normalize_tools(sent)}
    assert list(fns) == ["shell", "mcp__github__create_issue", "mcp__github__note", "clock__now"]
    assert spaces == {"mcp__github__create_issue": ("mcp__github__", "create_issue"),
                      "mcp__github__note": ("mcp__github__", "note"),
                      "clock__now": ("clock", "now")}
    # the namespace's description goes with each tool, unless it is only Codex's default
    assert fns["mcp__github__create_issue"]["description"] == (
        "Tools for working with GitHub.\n\nOpen an issue.")
    assert "description" not in fns["clock__now"]
    assert fns["mcp__github__create_issue"]["parameters"] == ISSUE["parameters"]
    assert fns["mcp__github__note"]["parameters"]["required"] == ["input"]   # (custom: one string)
    # Codex 0.171.0 names an MCP server's namespace without the trailing "__"
    assert namespaces.joined("mcp__demo", "echo") == namespaces.joined("mcp__demo__", "echo") == (
        "mcp__demo__echo")
    # the default namespace is no namespace
    sent, spaces, _ = namespaces.expand([{"type": "namespace", "name": "functions",
                                          "tools": [SHELL]}])
    assert [t["name"] for t in sent] == ["shell"] and spaces == {"shell": (None, "shell")}
    assert namespaces.split(spaces, "shell") == {"name": "shell"}
    assert namespaces.choice({"type": "function", "name": "now", "namespace": "clock"}) == {
        "type": "function", "name": "clock__now"}


def test_the_call_comes_back_with_its_namespace(srv, oai, forced):
    forced.arm("Filing. " + markup("mcp__github__create_issue", {"title": "bug"}))
    r = oai.responses.create(model="m", input="file it", tools=[SHELL, GITHUB],
                             max_output_tokens=200)
    call = r.model_dump()["output"][-1]
    assert call["type"] == "function_call" and call["namespace"] == "mcp__github__"
    assert call["name"] == "create_issue" and json.loads(call["arguments"]) == {"title": "bug"}
    echoed = r.model_dump()["tools"]                   # (the namespace as sent)
    assert [t["type"] for t in echoed] == ["function", "namespace"]
    assert echoed[1]["name"] == "mcp__github__" and len(echoed[1]["tools"]) == 2

    forced.arm(markup("mcp__github__note", {"input": "remember this"}))   # a custom tool in it
    raw = httpx.post(srv.v1 + "/responses", timeout=60, json={
        "input": "note it", "tools": [GITHUB], "max_output_tokens": 200, "stream": True})
    evs = sse_events(raw.text)
    added = [d["item"] for n, d in evs if n == "response.output_item.added"]
    done = [d["item"] for n, d in evs if n == "response.output_item.done"]
    assert added[-1]["type"] == done[-1]["type"] == "custom_tool_call"
    assert added[-1]["namespace"] == done[-1]["namespace"] == "mcp__github__"
    assert done[-1]["name"] == "note" and done[-1]["input"] == "remember this"

    forced.arm(markup("clock__now", {}))               # streamed function call events
    raw = httpx.post(srv.v1 + "/responses", timeout=60, json={
        "input": "time?", "tools": [CLOCK], "max_output_tokens": 200, "stream": True})
    evs = sse_events(raw.text)
    [args_done] = [d for n, d in evs if n == "response.function_call_arguments.done"]
    assert args_done["name"] == "now"
    final = evs[-1][1]["response"]["output"][-1]
    assert (final["namespace"], final["name"]) == ("clock", "now")


def test_namespaced_calls_are_history():
    items = normalize_input([
        {"role": "user", "content": "file it"},
        {"type": "function_call", "call_id": "c1", "namespace": "mcp__github__",
         "name": "create_issue", "arguments": '{"title": "bug"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "#12"},
        {"type": "custom_tool_call", "call_id": "c2", "namespace": "mcp__github__",
         "name": "note", "input": "x"}])
    msgs = items_to_messages(items, None)
    names = [tc["function"]["name"] for m in msgs for tc in m.get("tool_calls", ())]
    assert names == ["mcp__github__create_issue", "mcp__github__note"]


def test_namespace_history_over_http_and_previous_response_id(srv, oai, forced):
    forced.arm("Done.")
    r = oai.responses.create(model="m", max_output_tokens=20, tools=[GITHUB], input=[
        {"role": "user", "content": "file it"},
        {"type": "function_call", "call_id": "c1", "namespace": "mcp__github__",
         "name": "create_issue", "arguments": '{"title": "bug"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "#12"}])
    assert r.output_text == "Done."
    forced.arm(markup("mcp__github__create_issue", {"title": "bug"}))
    first = oai.responses.create(model="m", input="file it", tools=[GITHUB], max_output_tokens=200)
    call = first.model_dump()["output"][-1]
    forced.arm("Filed.")
    nxt = oai.responses.create(model="m", previous_response_id=first.id, tools=[GITHUB],
                               max_output_tokens=20, input=[{
                                   "type": "function_call_output", "call_id": call["call_id"],
                                   "output": "#12"}])
    assert nxt.output_text == "Filed."
    stored = httpx.get(srv.v1 + f"/responses/{first.id}", timeout=10).json()
    assert stored["output"][-1]["namespace"] == "mcp__github__"


def test_tool_choice_can_name_a_namespaced_tool(srv, oai):
    r = oai.responses.create(model="m", input="time?", tools=[SHELL, CLOCK], max_output_tokens=60,
                             tool_choice={"type": "function", "name": "now", "namespace": "clock"},
                             temperature=1.0)
    calls = [o for o in r.model_dump()["output"] if o["type"] == "function_call"]
    assert calls and all((c["namespace"], c["name"]) == ("clock", "now") for c in calls), calls


def test_bad_namespaces_are_400s(srv):
    for tool in ({"type": "namespace", "tools": [SHELL]},
                 {"type": "namespace", "name": "x", "tools": "no"},
                 {"type": "namespace", "name": "x", "description": 5, "tools": []},
                 {"type": "namespace", "name": "x", "tools": [{"type": "web_search"}]},
                 {"type": "namespace", "name": "x", "tools": [{"type": "function"}]},
                 {"type": "namespace", "name": "x.y", "tools": [SHELL]},      # (not a name)
                 {"type": "namespace", "name": "sh", "tools": [              # joined: "sh__ell"
                     {**SHELL, "name": "ell"}]}):
        r = httpx.post(srv.v1 + "/responses", timeout=60, json={
            "input": "hi", "tools": [tool, {**SHELL, "name": "sh__ell"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", (tool, r.text)
    r = httpx.post(srv.v1 + "/responses", timeout=60, json={"input": [
        {"type": "function_call", "name": "f", "namespace": 3, "arguments": "{}"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_choices_and_errors_name_the_request_as_sent(srv, oai):
    """(A hostile probe's findings.) A custom `tool_choice` with a namespace forces the
    namespace's tool, not a plain one of the same name; a namespace that is not a string is a
    400; errors name the tool where the request has it; an inner description must be a string;
    the default namespace's tools are echoed as the group only."""
    note = {"type": "custom", "name": "note", "description": "plain"}
    gh = {"type": "namespace", "name": "gh", "description": "d",
          "tools": [{"type": "custom", "name": "note"}]}
    r = oai.responses.create(model="m", input="note", tools=[note, gh], max_output_tokens=40,
                             tool_choice={"type": "custom", "name": "note", "namespace": "gh"},
                             temperature=1.0)
    calls = [o for o in r.model_dump()["output"] if o["type"] == "custom_tool_call"]
    assert calls and all(c.get("namespace") == "gh" for c in calls), r.output
    for bad in (5, [], {"a": 1}):
        resp = httpx.post(srv.v1 + "/responses", timeout=60, json={
            "input": "hi", "tools": [SHELL, CLOCK],
            "tool_choice": {"type": "function", "name": "now", "namespace": bad}})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "tool_choice", resp.text
    cases = [([{"type": "namespace", "name": "a", "tools": [SHELL, {"type": "function"}]}],
              "tools[0].tools[1]"),
             ([CLOCK, {"type": "custom", "name": "z", "format": 5}], "tools[1].format"),
             ([{"type": "namespace", "name": "a", "tools": [SHELL, SHELL]}],
              "tools[0].tools[1]: the tool name 'a__shell' is used twice"),
             ([{"type": "namespace", "name": "a", "description": "d",
                "tools": [{**SHELL, "description": 5}]}], "tools[0].tools[0].description")]
    for tools, where in cases:
        resp = httpx.post(srv.v1 + "/responses", timeout=60, json={"input": "hi", "tools": tools})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools", resp.text
        assert resp.json()["error"]["message"].startswith(where), resp.text
    r = oai.responses.create(model="m", input="hi", max_output_tokens=2, tools=[
        {"type": "namespace", "name": "functions", "tools": [SHELL]}])
    assert [t["type"] for t in r.model_dump()["tools"]] == ["namespace"]
