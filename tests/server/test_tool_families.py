"""Per-family tool markup reaches all three wire formats the same way.

The scripted model emits each family's native markup (Gemma 4 sentinel
tokens, MiniCPM XML with CDATA, Qwen's equals-XML and Llama's / Qwen2.5's JSON
inside `<tool_call>`); the call must come out as `tool_calls`, `tool_use` and
`function_call`, with the markup withheld and schema-typed arguments, and
streaming must give the same content and calls as non-streaming on every
protocol. (Format parsing itself is engine.text.tools' and is tested there,
including the any-chunking property test.)
"""

import json

import httpx
import pytest

from parity.fixtures.models import ensure_fixture
from srv_helpers import sse_events, start_server, stop_server

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}]

MARKUP = {
    "gemma4_text": '<|tool_call>call:lookup{q:<|"|>a, b {c}<|"|>,n:7}<tool_call|>',
    "minicpm": '<function name="lookup"><param name="q"><![CDATA[a, b {c}]]></param>'
               '<param name="n">7</param></function>',
    "qwen3": "<tool_call>\n<function=lookup>\n<parameter=q>\na, b {c}\n</parameter>\n"
             "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>",
    "llama": '<tool_call>\n{"name": "lookup", "arguments": {"q": "a, b {c}", "n": 7}}\n'
             '</tool_call>',
    # Qwen2.5: the same JSON-in-<tool_call> format, detected from the qwen2 fixture's template
    "qwen2": '<tool_call>\n{"name": "lookup", "arguments": {"q": "a, b {c}", "n": 7}}\n'
             '</tool_call>',
}
# a MiniCPM5 checkpoint is model_type llama: the parser comes from its chat template
MARKUP["minicpm5_llama"] = MARKUP["minicpm"]
WANT = {"q": "a, b {c}", "n": 7}


@pytest.fixture(scope="module", params=sorted(MARKUP))
def fam(request):
    s = start_server(ensure_fixture(request.param, "bfloat16"), forced=True, batch=1)
    s.family = request.param
    yield s
    stop_server(s)


def _post(s, path, body):
    r = httpx.post(s.v1 + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_markup_becomes_calls_on_every_protocol(fam):
    markup = MARKUP[fam.family]
    user = [{"role": "user", "content": "find it"}]
    fam.forced.arm("Sure. " + markup)
    c = _post(fam, "/chat/completions", {"messages": user, "tools": TOOLS, "max_tokens": 200,
                                         "temperature": 0})["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Sure. "
    assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) == WANT

    fam.forced.arm("Sure. " + markup)
    m = _post(fam, "/messages", {"messages": user, "max_tokens": 200, "temperature": 0,
                                 "tools": [{"name": "lookup", "input_schema":
                                            TOOLS[0]["function"]["parameters"]}]})
    assert [b["type"] for b in m["content"]] == ["text", "tool_use"]
    assert m["content"][1]["input"] == WANT and m["stop_reason"] == "tool_use"

    fam.forced.arm("Sure. " + markup)
    r = _post(fam, "/responses", {"input": "find it", "max_output_tokens": 200,
                                  "temperature": 0,
                                  "tools": [{"type": "function", **TOOLS[0]["function"]}]})
    fc = [o for o in r["output"] if o["type"] == "function_call"][0]
    assert fc["name"] == "lookup" and json.loads(fc["arguments"]) == WANT

    # streaming: the markup never shows up in the content deltas
    fam.forced.arm("Sure. " + markup)
    raw = httpx.post(fam.v1 + "/chat/completions", timeout=60, json={
        "messages": user, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
        "stream": True}).text
    content = "".join(json.loads(l[6:])["choices"][0]["delta"].get("content") or ""
                      for l in raw.splitlines() if l.startswith("data: {"))
    assert content == "Sure. "


def _stream(s, path, body):
    r = httpx.post(s.v1 + path, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    return sse_events(r.text)


def test_streaming_gives_the_same_calls_on_every_protocol(fam):
    markup = MARKUP[fam.family]
    user = [{"role": "user", "content": "find it"}]
    greedy = {"max_tokens": 200, "temperature": 0}

    # chat: content deltas, then one tool_calls delta, finish_reason tool_calls
    fam.forced.arm("Sure. " + markup)
    evs = [d for _, d in _stream(fam, "/chat/completions",
                                 {"messages": user, "tools": TOOLS, **greedy})[:-1]]
    deltas = [d["choices"][0]["delta"] for d in evs]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert calls[0]["function"]["name"] == "lookup"
    assert json.loads(calls[0]["function"]["arguments"]) == WANT
    assert evs[-1]["choices"][0]["finish_reason"] == "tool_calls"

    # anthropic: text block, then a tool_use block with one input_json_delta
    fam.forced.arm("Sure. " + markup)
    evs = _stream(fam, "/messages", {"messages": user, **greedy, "tools": [
        {"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}]})
    starts = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "lookup" and starts[1]["input"] == {}
    text = "".join(d["delta"]["text"] for n, d in evs
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    js = [d["delta"]["partial_json"] for n, d in evs
          if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert text == "Sure. " and len(js) == 1 and json.loads(js[0]) == WANT
    assert [d for n, d in evs if n == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"

    # responses: a message item, then a function_call item with arguments delta/done
    fam.forced.arm("Sure. " + markup)
    evs = _stream(fam, "/responses", {"input": "find it", "max_output_tokens": 200,
                                      "temperature": 0,
                                      "tools": [{"type": "function", **TOOLS[0]["function"]}]})
    added = [d["item"]["type"] for n, d in evs if n == "response.output_item.added"]
    assert added == ["message", "function_call"]
    text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
    args = [d["arguments"] for n, d in evs if n == "response.function_call_arguments.done"]
    assert text == "Sure. " and len(args) == 1 and json.loads(args[0]) == WANT
    final = evs[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]


def _cut(fam, markup: str, at: int) -> int:
    """Script "Sure. " + markup[:at] and more after it; the max_tokens that cuts there."""
    head = fam.forced.arm("Sure. " + markup[:at])
    fam.forced.arm(ids=head + head)      # (more after the cut: the limit ends it, not EOS)
    return len(head)


def test_a_call_the_token_limit_cuts_is_a_cut_call_on_every_protocol(fam):
    """A tool call cut by max_tokens after its `q` argument, inside `n`'s value: no protocol
    shows the raw markup as text; the call comes back with its name and only `q` (`n`'s "7"
    could have been 70), its arguments' JSON left open (it does not parse: Claude Code ran a
    cut call whose streamed input parsed), and the finish stays the token limit's (length /
    max_tokens / incomplete). Cut inside the tool's name: no call and no markup. (Before: the markup came
    back as content, `<tool_call>\\n{"name": ...`, reports/real_clients/JOURNAL.md, 0.6.3.)"""
    markup = MARKUP[fam.family]
    at = markup.rindex("7") + 1
    part = {"q": "a, b {c}"}
    opened = json.dumps(part)[:-1]       # '{"q": "a, b {c}"' : never parses as a whole call
    user = [{"role": "user", "content": "find it"}]

    n = _cut(fam, markup, at)
    c = _post(fam, "/chat/completions", {"messages": user, "tools": TOOLS, "max_tokens": n,
                                         "temperature": 0})["choices"][0]
    assert c["finish_reason"] == "length" and c["message"]["content"] == "Sure. "
    [tc] = c["message"]["tool_calls"]
    assert tc["function"]["name"] == "lookup" and tc["function"]["arguments"] == opened

    n = _cut(fam, markup, at)
    evs = [d for _, d in _stream(fam, "/chat/completions", {
        "messages": user, "tools": TOOLS, "max_tokens": n, "temperature": 0})[:-1]]
    deltas = [d["choices"][0]["delta"] for d in evs]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    [tc] = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert tc["function"]["arguments"] == opened
    assert evs[-1]["choices"][0]["finish_reason"] == "length"

    n = _cut(fam, markup, at)
    m = _post(fam, "/messages", {"messages": user, "max_tokens": n, "temperature": 0,
                                 "tools": [{"name": "lookup", "input_schema":
                                            TOOLS[0]["function"]["parameters"]}]})
    assert m["stop_reason"] == "max_tokens"
    assert [b["type"] for b in m["content"]] == ["text", "tool_use"]
    assert m["content"][0]["text"] == "Sure. " and m["content"][1]["input"] == part
    evs = _stream(fam, "/messages", {"messages": user, "max_tokens": _cut(fam, markup, at),
                                     "temperature": 0, "tools": [
                                         {"name": "lookup", "input_schema":
                                          TOOLS[0]["function"]["parameters"]}]})
    js = [d["delta"]["partial_json"] for n, d in evs
          if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert "".join(js) == opened         # (streamed as Anthropic does: JSON that does not parse)
    assert [d for n, d in evs if n == "message_delta"][0]["delta"]["stop_reason"] == "max_tokens"

    n = _cut(fam, markup, at)
    r = _post(fam, "/responses", {"input": "find it", "max_output_tokens": n, "temperature": 0,
                                  "tools": [{"type": "function", **TOOLS[0]["function"]}]})
    assert r["status"] == "incomplete"
    [fc] = [o for o in r["output"] if o["type"] == "function_call"]
    assert fc["status"] == "incomplete" and fc["arguments"] == opened
    texts = [p["text"] for o in r["output"] if o["type"] == "message" for p in o["content"]]
    assert texts == ["Sure. "]

    # cut inside the tool's name: nothing to call, and still no markup as text
    n = _cut(fam, markup, markup.index("lookup") + 3)
    c = _post(fam, "/chat/completions", {"messages": user, "tools": TOOLS, "max_tokens": n,
                                         "temperature": 0})["choices"][0]
    assert c["finish_reason"] == "length" and c["message"]["content"] == "Sure. "
    assert not c["message"].get("tool_calls")
    # a whole call, then the limit inside the next one's name: the first call, and the finish
    # is still the limit's (it was "tool_calls": the turn looked finished)
    two = markup + "\n" + markup
    n = _cut(fam, two, len(markup) + 1 + markup.index("lookup") + 3)
    c = _post(fam, "/chat/completions", {"messages": user, "tools": TOOLS, "max_tokens": n,
                                         "temperature": 0})["choices"][0]
    assert c["finish_reason"] == "length" and len(c["message"]["tool_calls"]) == 1
    assert c["message"]["content"] in ("Sure. ", "Sure. \n")
