"""Freeform `custom` tools on /v1/responses (Codex CLI's `apply_patch`): the model sees a
function of one string `input` whose description carries the format's grammar; its call comes
back as a `custom_tool_call` item (streamed: `response.custom_tool_call_input.delta/.done`)
that the OpenAI SDK parses; `custom_tool_call` and `custom_tool_call_output` items are taken
back as history, sent again or through `previous_response_id`. Before: the tool was a function
of no parameters, its call a `function_call`, and those input items a 400."""

import json

import httpx

from server.custom_tools import INPUT
from server.messages import normalize_tools
from srv_helpers import sse_events

GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'
PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi \"there\"\n*** End Patch"
MARKUP = ('<tool_call>\n{"name": "apply_patch", "arguments": {"input": ' + json.dumps(PATCH)
          + '}}\n</tool_call>')


def test_a_custom_tool_is_a_function_of_one_string_with_its_grammar_shown():
    [fn] = normalize_tools([PATCH_TOOL])
    f = fn["function"]
    assert f["name"] == "apply_patch" and f["parameters"]["required"] == [INPUT]
    assert f["parameters"]["properties"] == {INPUT: {"type": "string"}}
    assert f["description"].startswith("Edit files with a patch.") and GRAMMAR in f["description"]
    # chat completions' nested form, and a text format
    [fn] = normalize_tools([{"type": "custom", "custom": {"name": "note", "format": {"type": "text"}}}])
    assert fn["function"]["name"] == "note" and "description" not in fn["function"]


def test_bad_custom_tools_are_400s(srv):
    for tool in ({"type": "custom"}, {"type": "custom", "name": "x", "format": "lark"},
                 {"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "lark"}},
                 {"type": "custom", "name": "x", "format": {"type": "json"}},
                 {"type": "custom", "name": "x", "format": {}},
                 {"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "peg",
                                                            "definition": "a"}},
                 {"type": "custom", "custom": "str", "name": "x"}):
        r = httpx.post(srv.v1 + "/responses", json={"input": "hi", "tools": [tool]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", (tool, r.text)


def test_the_call_is_a_custom_tool_call_item(srv, oai, forced):
    forced.arm("Patching. " + MARKUP)
    r = oai.responses.create(model="m", input="add a.txt", tools=[PATCH_TOOL, SHELL],
                             max_output_tokens=200)
    calls = [o for o in r.output if o.type == "custom_tool_call"]
    assert [o.type for o in r.output] == ["message", "custom_tool_call"], r.output
    assert calls[0].name == "apply_patch" and calls[0].input == PATCH and calls[0].call_id
    assert r.output_text == "Patching. " and r.status == "completed"
    echoed = r.model_dump()["tools"]              # (as sent: the custom one stays custom)
    assert [t["type"] for t in echoed] == ["custom", "function"]
    assert echoed[0]["format"]["definition"] == GRAMMAR

    forced.arm("Patching. " + MARKUP)        # streamed: the same item, input delta + done
    raw = httpx.post(srv.v1 + "/responses", timeout=60, json={
        "input": "add a.txt", "tools": [PATCH_TOOL, SHELL], "max_output_tokens": 200,
        "stream": True})
    evs = sse_events(raw.text)
    names = [n for n, _ in evs]
    assert "response.function_call_arguments.delta" not in names
    delta = [d["delta"] for n, d in evs if n == "response.custom_tool_call_input.delta"]
    done = [d["input"] for n, d in evs if n == "response.custom_tool_call_input.done"]
    assert "".join(delta) == PATCH and done == [PATCH]
    added = [d["item"] for n, d in evs if n == "response.output_item.added"]
    assert [a["type"] for a in added] == ["message", "custom_tool_call"] and added[1]["input"] == ""
    final = evs[-1][1]["response"]["output"][-1]
    assert final["type"] == "custom_tool_call" and final["input"] == PATCH
    assert final["status"] == "completed"


def test_custom_tool_calls_are_history(srv, oai, forced):
    forced.arm("Done.")
    r = oai.responses.create(model="m", max_output_tokens=20, tools=[PATCH_TOOL], input=[
        {"role": "user", "content": "add a.txt"},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Success."}])
    assert r.output_text == "Done."
    # a stored turn that called the custom tool continues through previous_response_id
    forced.arm("Patching. " + MARKUP)
    first = oai.responses.create(model="m", input="add a.txt", tools=[PATCH_TOOL],
                                 max_output_tokens=200)
    call = [o for o in first.output if o.type == "custom_tool_call"][0]
    forced.arm("All done.")
    nxt = oai.responses.create(model="m", previous_response_id=first.id, tools=[PATCH_TOOL],
                               max_output_tokens=20, input=[{
                                   "type": "custom_tool_call_output", "call_id": call.call_id,
                                   "output": "Success."}])
    assert nxt.output_text == "All done."
    for bad in ({"type": "custom_tool_call", "input": "x"},
                {"type": "custom_tool_call", "name": "apply_patch", "input": 5},
                {"type": "custom_tool_call", "name": "apply_patch"},
                {"type": "custom_tool_call", "name": "apply_patch", "input": "x", "call_id": 5}):
        r = httpx.post(srv.v1 + "/responses", timeout=60, json={"input": [bad]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_tool_choice_can_name_a_custom_tool(srv, oai, forced):
    """`tool_choice: {type: "custom", name}` forces that tool (was a 400)."""
    r = oai.responses.create(model="m", input="add a.txt", tools=[PATCH_TOOL, SHELL],
                             tool_choice={"type": "custom", "name": "apply_patch"},
                             max_output_tokens=60, temperature=1.0)
    calls = [o for o in r.output if o.type in ("custom_tool_call", "function_call")]
    assert calls and all(c.type == "custom_tool_call" and c.name == "apply_patch"
                         for c in calls), r.output
    assert r.tool_choice.type == "custom"           # (echoed as sent)


def test_chat_completions_custom_tools_both_ways(srv, oai, forced):
    """On chat completions a custom tool's call comes back in OpenAI's custom shape
    (`{type: custom, custom: {name, input}}`, which the SDK parses) and is taken back as
    history (was a 400: "needs a function name")."""
    forced.arm("Patching. " + MARKUP)
    r = oai.chat.completions.create(model="m", max_tokens=200, messages=[
        {"role": "user", "content": "add a.txt"}], tools=[
        {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files."}},
        {"type": "function", "function": {"name": "shell", "parameters": SHELL["parameters"]}}])
    [tc] = r.choices[0].message.tool_calls
    assert tc.type == "custom" and tc.custom.name == "apply_patch" and tc.custom.input == PATCH
    assert r.choices[0].finish_reason == "tool_calls"
    forced.arm("Done.")
    r2 = oai.chat.completions.create(model="m", max_tokens=20, messages=[
        {"role": "user", "content": "add a.txt"},
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": "Success."}], tools=[
        {"type": "custom", "custom": {"name": "apply_patch"}}])
    assert r2.choices[0].message.content == "Done."
    bad = httpx.post(srv.v1 + "/chat/completions", timeout=60, json={"max_tokens": 5, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "a"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]})
    assert bad.status_code == 400 and "custom.input" in bad.json()["error"]["message"]



def test_a_forced_regex_custom_tool_call_matches_its_regex(srv, oai):
    """A custom tool whose format is a regex: a forced call's input matches it (the regex is
    the `input` parameter's pattern, which the forced-call grammar holds the model to; the
    random model, unforced by it, wrote 200 tokens of anything and never closed the call)."""
    import re
    rx = r"[a-z]{3}-[0-9]{2}"
    tool = {"type": "custom", "name": "code", "description": "A code.",
            "format": {"type": "grammar", "syntax": "regex", "definition": rx}}
    [fn] = normalize_tools([tool])
    # (anchored: a JSON Schema pattern matches anywhere in the string, the custom tool's regex
    # the whole input)
    assert fn["function"]["parameters"]["properties"][INPUT] == {"type": "string",
                                                                 "pattern": f"^(?:{rx})$"}
    got = []
    for seed in range(3):
        r = oai.responses.create(model="m", input="a code", tools=[tool], max_output_tokens=80,
                                 tool_choice={"type": "custom", "name": "code"},
                                 temperature=1.0, extra_body={"seed": seed})
        got += [o.input for o in r.output if o.type == "custom_tool_call"]
    assert got and all(re.fullmatch(rx, x) for x in got), got
