"""/v1/chat/completions and /v1/completions through the official openai SDK."""

import json
import uuid

import httpx
import pytest

from srv_helpers import TOOLS, sse_events


def uniq(prefix="hello"):
    # a fresh prompt per test, so no prompt-cache hit changes the path being compared
    return f"{prefix} {uuid.uuid4().hex[:8]}"


def test_chat_greedy_equals_in_process(srv, oai):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": uniq()}]
    r = oai.chat.completions.create(model="whatever", messages=msgs, max_tokens=12,
                                    temperature=0)
    ref = srv.generate(msgs, max_tokens=12, temperature=0.0)
    c = r.choices[0]
    assert c.message.content == ref.text
    assert c.message.role == "assistant"
    assert c.finish_reason == ref.finish_reason
    assert r.model == srv.state.model_id
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == ref.prompt_tokens
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_chat_stream_matches_non_stream(srv, oai):
    msgs = [{"role": "user", "content": uniq()}]
    full = oai.chat.completions.create(model="m", messages=msgs, max_tokens=10, temperature=0)
    chunks = list(oai.chat.completions.create(model="m", messages=msgs, max_tokens=10,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    last = chunks[-1]
    assert last.choices[0].finish_reason == full.choices[0].finish_reason
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # the second, identical prompt reused the prompt cache
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_wire_ends_with_done(srv):
    body = {"messages": [{"role": "user", "content": uniq()}], "max_tokens": 3,
            "temperature": 0, "stream": True}
    r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    evs = sse_events(r.text)
    assert evs[-1] == (None, "[DONE]")
    assert evs[-2][1]["usage"]["prompt_tokens"] > 0


def test_max_completion_tokens_wins(oai):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": uniq()}],
                                    max_tokens=9, max_completion_tokens=3, temperature=0,
                                    logit_bias={str(i): -100 for i in (998, 1000)})
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_seeded_sampling_and_precedence(srv, oai):
    msgs = [{"role": "user", "content": uniq()}]
    got = oai.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=1.5,
                                      top_p=0.9, seed=11)
    ref = srv.generate(msgs, max_tokens=8, temperature=1.5,
                          top_p=0.9, seed=11)
    assert got.choices[0].message.content == ref.text
    # no temperature in the request: generation_config.json's sampling (temp 0.6, top_k 20..)
    msgs2 = [{"role": "user", "content": uniq()}]
    got2 = oai.chat.completions.create(model="m", messages=msgs2, max_tokens=8, seed=5)
    ref2 = srv.generate(msgs2, max_tokens=8, seed=5)
    assert got2.choices[0].message.content == ref2.text


def test_stop_string_cut_and_streamed_never(forced, oai):
    forced.arm("alpha beta STOP gamma")
    msgs = [{"role": "user", "content": uniq()}]
    r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0,
                                    stop=["STOP", "zzz"])
    assert r.choices[0].message.content == "alpha beta "
    assert r.choices[0].finish_reason == "stop"
    forced.arm("alpha beta STOP gamma")
    chunks = list(oai.chat.completions.create(model="m", messages=msgs, max_tokens=30,
                                              temperature=0, stop="STOP", stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(deltas) == "alpha beta "
    assert not any("ST" in d for d in deltas)


def test_logprobs(srv, oai):
    msgs = [{"role": "user", "content": uniq()}]
    r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=3)
    ref = srv.generate(msgs, max_tokens=5, temperature=0.0,
                          logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    for entry, lp in zip(content, ref.logprobs):
        assert entry.logprob == pytest.approx(lp["logprob"], abs=0)
        assert entry.model_extra["id"] == lp["token"]
        assert [t.model_extra["id"] for t in entry.top_logprobs] == [i for i, _ in lp["top"]]
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "zip": 75001}}\n</tool_call>'


def test_tool_call_non_stream_and_stream(forced, oai):
    msgs = [{"role": "user", "content": uniq("weather in Paris?")}]
    forced.arm(CALL)
    r = oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=80,
                                    temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == ""
    (tc,) = c.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_")
    assert tc.function.name == "get_weather"
    # arguments decoded against the schema: the string-typed zip stays a string
    assert json.loads(tc.function.arguments) == {"city": "Paris", "days": 3, "zip": "75001"}

    forced.arm("Let me check." + CALL)
    chunks = list(oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS,
                                              max_tokens=80, temperature=0, stream=True))
    kinds = []
    for ch in chunks:
        d = ch.choices[0].delta
        if d.content:
            kinds.append(("content", d.content))
        if d.tool_calls:
            kinds.append(("tool", d.tool_calls))
    # content before the markup streamed first, then the call, nothing of the markup leaked
    assert "".join(v for k, v in kinds if k == "content") == "Let me check."
    assert kinds[-1][0] == "tool"
    (stc,) = kinds[-1][1]
    assert stc.index == 0 and stc.function.name == "get_weather"
    assert json.loads(stc.function.arguments) == json.loads(tc.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip(srv, forced, oai):
    from engine.step.generation import encode_prompt
    msgs = [{"role": "user", "content": uniq("weather?")}]
    forced.arm(CALL)
    r = oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=80,
                                    temperature=0)
    tc = r.choices[0].message.tool_calls[0]
    forced.arm("It is sunny.")
    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temp": 21}'}]
    r2 = oai.chat.completions.create(model="m", messages=follow, tools=TOOLS, max_tokens=20,
                                     temperature=0)
    assert r2.choices[0].message.content == "It is sunny."
    assert r2.choices[0].finish_reason == "stop"
    # the template saw the call with parsed arguments and the tool result
    want = encode_prompt(srv.tokenizer, msgs + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": tc.id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.loads(tc.function.arguments)}}]},
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temp": 21}'}], TOOLS)
    assert r2.usage.prompt_tokens == len(want)
    text = srv.tokenizer.decode(want)
    assert "<tool_response>" in text and '"city": "Paris"' in text
    # multi-turn: the shared prefix came from the prompt cache
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_tool_choice_none_leaves_markup_as_content(forced, oai):
    forced.arm(CALL)
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": uniq()}],
                                    tools=TOOLS, tool_choice="none", max_tokens=80,
                                    temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == CALL
    assert r.choices[0].finish_reason == "stop"


def test_unparseable_markup_falls_back_to_content(forced, oai):
    bad = "<tool_call>\n{not json}\n</tool_call>"
    forced.arm(bad)
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": uniq()}],
                                    tools=TOOLS, max_tokens=80, temperature=0)
    assert r.choices[0].message.content == bad
    assert r.choices[0].message.tool_calls is None


def test_completions_raw_text(srv, oai):
    prompt = uniq("def fib(n):")
    r = oai.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0)
    ref = srv.generate(prompt, max_tokens=10, temperature=0.0)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == ref.prompt_tokens == len(srv.tokenizer.encode(prompt))
    chunks = list(oai.completions.create(model="m", prompt=prompt, max_tokens=10,
                                         temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_logprobs_and_token_prompt(srv, oai):
    ids = srv.tokenizer.encode(uniq("x ="))
    r = oai.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    ref = srv.generate(ids, max_tokens=4, temperature=0.0,
                          top_logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [e["logprob"] for e in ref.logprobs]
    assert len(lp.top_logprobs) == len(ref.token_ids) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.tokens == [srv.tokenizer.decode([e["token"]]) for e in ref.logprobs]
    assert r.choices[0].text == ref.text


def test_chat_template_kwargs_and_reasoning_effort(srv, oai):
    from engine.step.generation import encode_prompt
    msgs = [{"role": "user", "content": uniq()}]
    plain = oai.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0)
    off = oai.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0,
                                      extra_body={"chat_template_kwargs":
                                                  {"enable_thinking": False}})
    # qwen3's template opens an empty <think></think> block when thinking is off
    want = encode_prompt(srv.tokenizer, msgs, None, {"enable_thinking": False})
    assert off.usage.prompt_tokens == len(want) > plain.usage.prompt_tokens
    eff = oai.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0,
                                      reasoning_effort="none")
    assert eff.usage.prompt_tokens == len(want)
