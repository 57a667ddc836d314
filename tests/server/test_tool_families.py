"""Per-family tool markup reaches all three wire formats the same way.

The scripted model emits each family's native markup (Gemma 4 sentinel
tokens, MiniCPM XML with CDATA); the call must come out as `tool_calls`,
`tool_use` and `function_call`, with the markup withheld and schema-typed
arguments. (Format parsing itself is engine.tools' and is tested there.)
"""

import json

import httpx
import pytest

from parity.fixtures.models import ensure_fixture
from srv_helpers import start_server, stop_server

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}]

MARKUP = {
    "gemma4_text": '<|tool_call>call:lookup{q:<|"|>a, b {c}<|"|>,n:7}<tool_call|>',
    "minicpm": '<function name="lookup"><param name="q"><![CDATA[a, b {c}]]></param>'
               '<param name="n">7</param></function>',
}
WANT = {"q": "a, b {c}", "n": 7}


@pytest.fixture(scope="module", params=sorted(MARKUP))
def fam(request):
    s = start_server(ensure_fixture(request.param, "bfloat16"), forced=True)
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
