"""No request stalls the others, and no invalid output is a success.

- A grammar compiles after the queue checks, on a worker thread: `/health`
  answers while a compile is in progress (held open by the test with events),
  and a compile past `--max-grammar-ms` is a 400 naming the limit.
- Schemas no grammar can honour are a 400 before generation (llguidance gives
  up, special-token text, `$ref` loops, impossible lengths, not a JSON Schema),
  and a grammar that dead-ends mid-generation ends with an error on every
  protocol (never `finish_reason: "stop"` / `status: "completed"`).
- Tool names (`^[a-zA-Z0-9_-]{1,64}$`, unique) and tool parameter schemas are checked.
"""

from __future__ import annotations

import threading

import httpx
import llguidance
import pytest

from srv_helpers import uniq


def _chat(srv, body, timeout=60):
    return httpx.post(srv.v1 + "/chat/completions", timeout=timeout,
                      json={"model": "m", "max_tokens": 16, **body})


def _schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}


class _HeldCompiler:
    """`llguidance` as the grammar code sees it, with `grammar_from_lark` held until released."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        outer = self

        class LLMatcher:
            def __new__(cls, *a, **k):
                return llguidance.LLMatcher(*a, **k)

            @staticmethod
            def grammar_from_lark(lark):
                outer.entered.set()
                outer.release.wait(30)
                return llguidance.LLMatcher.grammar_from_lark(lark)
        self.LLMatcher = LLMatcher

    def __getattr__(self, name):
        return getattr(llguidance, name)


@pytest.fixture
def held(monkeypatch):
    import engine.constrained.processor as proc
    h = _HeldCompiler()
    monkeypatch.setattr(proc, "llguidance", h)
    yield h
    h.release.set()


def test_health_answers_while_a_grammar_compiles(srv, held):
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 7}},
              "required": ["k"]}
    box = {}
    t = threading.Thread(target=lambda: box.update(r=_chat(srv, {"messages": [
        {"role": "user", "content": uniq()}], "response_format": _schema(schema)})))
    t.start()
    assert held.entered.wait(30), "the compile never started"
    # the compile is in progress (held): the event loop must still answer, and another
    # request streams to its end meanwhile
    h = httpx.get(srv.url + "/health", timeout=10)
    assert h.status_code == 200
    with httpx.stream("POST", srv.v1 + "/chat/completions", timeout=30, json={
            "model": "m", "max_tokens": 12, "stream": True,
            "messages": [{"role": "user", "content": uniq()}]}) as s:
        raw = "".join(s.iter_text())
    assert s.status_code == 200 and "data: [DONE]" in raw
    assert not held.release.is_set() and t.is_alive()
    held.release.set()
    t.join(60)
    assert box["r"].status_code == 200, box["r"].text


def test_compile_over_budget_is_400_naming_the_limit(srv, held, monkeypatch):
    monkeypatch.setattr(srv.state.config, "max_grammar_ms", 50.0)
    schema = {"type": "object", "properties": {"q": {"type": "integer", "maximum": 3}}}
    r = _chat(srv, {"messages": [{"role": "user", "content": uniq()}],
                    "response_format": _schema(schema)})
    held.release.set()
    assert r.status_code == 400, r.text
    assert "--max-grammar-ms" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"


def test_schema_is_compiled_once(srv, monkeypatch):
    import engine.constrained.processor as proc
    made = []
    real = proc.llguidance.LLMatcher

    class Counting:
        grammar_from_lark = staticmethod(real.grammar_from_lark)

        def __new__(cls, lt, grammar, *a, **k):
            if '"once"' in grammar:      # (not another test's compile finishing late)
                made.append(1)
            return real(lt, grammar, *a, **k)

    class LL:
        LLMatcher = Counting

        def __getattr__(self, name):
            return getattr(llguidance, name)
    monkeypatch.setattr(proc, "llguidance", LL())
    schema = {"type": "object", "properties": {"once": {"type": "integer", "minimum": 11}},
              "required": ["once"]}
    for _ in range(3):
        r = _chat(srv, {"messages": [{"role": "user", "content": uniq()}],
                        "response_format": _schema(schema), "max_tokens": 40})
        assert r.status_code == 200, r.text
    assert len(made) == 1      # compiled by the first request; copied by the others


OPTIONAL_600 = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                 for i in range(600)}}
REF_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a"}
UNSUPPORTED = {
    "optional_600": OPTIONAL_600,
    "special_const": {"const": "x<|im_end|>y"},
    "special_enum": {"type": "object", "properties": {"k": {"enum": ["ok", "a<|im_end|>"]}}},
    "special_key": {"type": "object", "properties": {"a<|endoftext|>": {"type": "integer"}},
                    "required": ["a<|endoftext|>"]},
    "ref_root": {"$ref": "#"},
    "ref_loop": REF_LOOP,
    "required_recursion": {"type": "object", "properties": {"a": {"$ref": "#"}},
                           "required": ["a"]},
    "min_items_1e9": {"type": "array", "minItems": 10**9},
    "nested_repeat_regex": {"type": "string", "pattern": "((a{100}){100}){100}"},
    "not_a_schema": {"type": "strng"},
    "too_many_nodes": {"enum": list(range(20_000))},
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_schema_is_400_before_generation(srv, name):
    r = _chat(srv, {"messages": [{"role": "user", "content": uniq()}],
                    "response_format": _schema(UNSUPPORTED[name])})
    assert r.status_code == 400, (name, r.status_code, r.text[:300])
    assert r.json()["error"]["param"].startswith("response_format")


def test_unsupported_schema_400_on_responses(srv):
    r = httpx.post(srv.v1 + "/responses", timeout=60, json={
        "model": "m", "input": uniq(), "max_output_tokens": 8,
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"$ref": "#"}}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("text.format")


# a grammar that dead-ends past the compile-time probe (which stays inside "s"): "t" must
# spell a special token's text, which no token writes (patterns are not checked up front)
DEEP_DEAD_END = {"type": "object", "properties": {
    "s": {"type": "string", "maxLength": 12},
    "t": {"type": "string", "pattern": "^a<\\|im_end\\|>$"}}, "required": ["s", "t"]}


def test_dead_end_mid_generation_is_an_error_not_success(srv):
    msgs = [{"role": "user", "content": uniq()}]
    r = _chat(srv, {"messages": msgs, "response_format": _schema(DEEP_DEAD_END),
                    "max_tokens": 64})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_dead_end" and err["param"] == "response_format"
    # streamed: an error event, never a finish_reason "stop"
    with httpx.stream("POST", srv.v1 + "/chat/completions", timeout=60, json={
            "model": "m", "max_tokens": 64, "stream": True, "messages": msgs,
            "response_format": _schema(DEEP_DEAD_END)}) as s:
        raw = "".join(s.iter_text())
    assert '"code":"grammar_dead_end"' in raw.replace(" ", ""), raw[-500:]
    assert '"finish_reason":"stop"' not in raw.replace(" ", ""), raw[-500:]


def test_dead_end_on_responses_is_failed(srv):
    with httpx.stream("POST", srv.v1 + "/responses", timeout=60, json={
            "model": "m", "input": uniq(), "max_output_tokens": 64, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "o",
                                "schema": DEEP_DEAD_END}}}) as s:
        raw = "".join(s.iter_text())
    assert "response.failed" in raw and "response.completed" not in raw, raw[-500:]


def test_dead_end_on_messages_is_an_error_event(srv):
    tools = [{"name": "deep", "input_schema": DEEP_DEAD_END}]
    with httpx.stream("POST", srv.url + "/v1/messages", timeout=60, json={
            "model": "m", "max_tokens": 64, "stream": True, "tools": tools,
            "tool_choice": {"type": "tool", "name": "deep"},
            "messages": [{"role": "user", "content": uniq()}]}) as s:
        raw = "".join(s.iter_text())
    assert "event: error" in raw and '"stop_reason": "end_turn"' not in raw, raw[-500:]


FN = {"type": "object", "properties": {"x": {"type": "integer"}}}


@pytest.mark.parametrize("tools,needle", [
    ([{"type": "function", "function": {"name": "a b<|im_end|>", "parameters": FN}}],
     "must match"),
    ([{"type": "function", "function": {"name": "x" * 65, "parameters": FN}}], "must match"),
    ([{"type": "function", "function": {"name": "f", "parameters": FN}},
      {"type": "function", "function": {"name": "f", "parameters": FN}}], "used twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
     "not a valid JSON Schema"),
])
def test_bad_tools_are_400(srv, tools, needle):
    r = _chat(srv, {"messages": [{"role": "user", "content": uniq()}], "tools": tools})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and r.json()["error"]["param"] == "tools"


def test_bad_tool_name_is_400_on_messages(srv):
    r = httpx.post(srv.url + "/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": uniq()}],
        "tools": [{"name": "a b<|im_end|>", "input_schema": FN}],
        "tool_choice": {"type": "any"}})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and "must match" in r.json()["error"]["message"]


def test_forced_call_with_special_text_in_its_schema_is_400(srv):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"k": {"const": "x<|im_end|>"}}, "required": ["k"]}}}]
    r = _chat(srv, {"messages": [{"role": "user", "content": uniq()}], "tools": tools,
                    "tool_choice": "required"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice"
    assert "special token" in r.json()["error"]["message"]
