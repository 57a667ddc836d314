"""/v1/messages through the official anthropic SDK (and the raw event grammar)."""

import json

import anthropic
import httpx
import pytest

from srv_helpers import sse_events, uniq

TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {
              "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}},
         {"type": "web_search_20250305", "name": "web_search"}]   # server tool: dropped
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
GREEDY = {"temperature": 0}


def test_plain_equals_in_process(srv, claude):
    q = uniq()
    m = claude.messages.create(model="x", max_tokens=10, system="be brief",
                               messages=[{"role": "user", "content": q}], extra_body=GREEDY)
    ref = srv.generate([{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": q}],
                          max_tokens=10, temperature=0.0)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == srv.state.model_id
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == ref.text
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
    assert m.usage.output_tokens == len(ref.token_ids)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.prompt_tokens


def test_blocks_and_body_sampling_fields(srv):
    # system as text blocks, content as blocks, temperature in the body (not extra_body)
    q = uniq()
    body = {"model": "x", "max_tokens": 6, "temperature": 0, "top_k": 1,
            "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": q}]}]}
    r = httpx.post(srv.v1 + "/messages", json=body, timeout=30).json()
    ref = srv.generate([{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": q}],
                          max_tokens=6, temperature=0.0)
    assert r["content"][0]["text"] == ref.text


def test_stream_grammar_and_sdk_accumulation(srv, claude):
    msgs = [{"role": "user", "content": uniq()}]
    full = claude.messages.create(model="x", max_tokens=8, messages=msgs, extra_body=GREEDY)
    with claude.messages.stream(model="x", max_tokens=8, messages=msgs,
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0      # second time: prompt-cache hit
    body = {"model": "x", "max_tokens": 5, "messages": msgs, "stream": True, "temperature": 0}
    evs = sse_events(httpx.post(srv.v1 + "/messages", json=body, timeout=30).text)
    names = [n for n, _ in evs]
    assert all(n == d["type"] for n, d in evs)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert evs[-2][1]["usage"]["output_tokens"] == 5
    assert evs[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_stop_sequences(forced, claude):
    forced.arm("one two END three")
    m = claude.messages.create(model="x", max_tokens=30, stop_sequences=["END"],
                               messages=[{"role": "user", "content": uniq()}],
                               extra_body=GREEDY)
    assert m.content[0].text == "one two "
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "END"
    forced.arm("one two")
    m = claude.messages.create(model="x", max_tokens=30, stop_sequences=["END"],
                               messages=[{"role": "user", "content": uniq()}],
                               extra_body=GREEDY)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None


def test_tool_use_round_trip(srv, forced, claude):
    msgs = [{"role": "user", "content": uniq("weather in Oslo?")}]
    forced.arm("Checking." + CALL)
    m = claude.messages.create(model="x", max_tokens=80, tools=TOOLS, messages=msgs,
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == "Checking."
    tu = m.content[1]
    assert tu.name == "get_weather" and tu.input == {"city": "Oslo", "days": 2}
    assert tu.id.startswith("toolu_")

    forced.arm("Checking." + CALL)
    with claude.messages.stream(model="x", max_tokens=80, tools=TOOLS, messages=msgs,
                                extra_body=GREEDY) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == tu.input
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert any(d.type == "input_json_delta" and json.loads(d.partial_json) == tu.input
               for d in deltas)

    forced.arm("Sunny.")
    follow = msgs + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id,
                                                   "content": "4 degrees"}]}]
    m2 = claude.messages.create(model="x", max_tokens=20, tools=TOOLS, messages=follow,
                                extra_body=GREEDY)
    assert m2.content[0].text == "Sunny." and m2.stop_reason == "end_turn"
    assert m2.usage.cache_read_input_tokens > 0
    n = claude.messages.count_tokens(model="x", tools=TOOLS, messages=follow)
    assert n.input_tokens == m2.usage.input_tokens + m2.usage.cache_read_input_tokens


def test_errors_have_anthropic_shape(srv, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="x", max_tokens=5, messages=[])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(srv.v1 + "/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(srv.v1 + "/messages", content=b"{nope")
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(srv.v1 + "/messages", json={"max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and "vision" in r.json()["error"]["message"]
    # and it keeps serving
    m = claude.messages.create(model="x", max_tokens=2, messages=[{"role": "user",
                                                                   "content": "ok"}])
    assert m.usage.output_tokens >= 0


def test_empty_content_is_a_400_except_a_final_assistant_prefill(srv):
    """Anthropic's rule (a probe found `"content": []` on a user turn answered 200)."""
    for msgs in ([{"role": "user", "content": []}],
                 [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
                  {"role": "user", "content": "go on"}]):
        r = httpx.post(srv.v1 + "/messages", json={"model": "x", "max_tokens": 4, "messages": msgs},
                       timeout=30)
        assert r.status_code == 400 and "non-empty content" in r.json()["error"]["message"]
    ok = httpx.post(srv.v1 + "/messages", timeout=30, json={
        "model": "x", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]})
    assert ok.status_code == 200
