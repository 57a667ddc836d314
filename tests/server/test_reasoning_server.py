"""Reasoning split out of the content on all three protocols, through the
official SDKs: OpenAI chat `reasoning_content` / `reasoning` (message and
stream deltas), Anthropic `thinking` blocks and `thinking_delta` events,
Responses `reasoning` items and `response.reasoning_text.*` events. The
fixture models are random, so the output is scripted (`srv.forced`);
streaming and non-streaming must give the same split."""

from __future__ import annotations

import pytest

from srv_helpers import TOOLS, uniq

SCRIPT = "<think>\nweighing 2 and 2\n</think>\n\nThe answer is four."
REASONING, CONTENT = "weighing 2 and 2", "The answer is four."


def test_openai_chat_reasoning_split(oai, forced):
    msgs = [{"role": "user", "content": uniq("2+2?")}]
    forced.arm(SCRIPT)
    r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=64, temperature=0)
    m = r.choices[0].message
    assert m.content == CONTENT
    extra = m.model_extra
    assert extra["reasoning_content"] == REASONING and extra["reasoning"] == REASONING
    forced.arm(SCRIPT)
    reasoning, reasoning2, content = [], [], []
    for ch in oai.chat.completions.create(model="m", messages=msgs, max_tokens=64,
                                          temperature=0, stream=True):
        d = ch.choices[0].delta
        reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
        reasoning2.append((d.model_extra or {}).get("reasoning") or "")
        content.append(d.content or "")
    assert "".join(reasoning) == "".join(reasoning2) == REASONING
    assert "".join(content) == CONTENT


def test_openai_reasoning_then_tool_call(oai, forced):
    forced.arm('<think>need weather</think><tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Paris"}}\n</tool_call>')
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": uniq()}],
                                    tools=TOOLS, max_tokens=64, temperature=0)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "need weather"
    assert [c.function.name for c in m.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"


def test_no_reasoning_fields_without_reasoning(oai, forced):
    forced.arm("plain answer")
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": uniq()}],
                                    max_tokens=32, temperature=0)
    assert r.choices[0].message.content == "plain answer"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_completions_are_not_split(oai, forced):
    forced.arm(SCRIPT)
    r = oai.completions.create(model="m", prompt=uniq(), max_tokens=64, temperature=0)
    assert r.choices[0].text == SCRIPT       # a raw prompt: the text verbatim


def test_anthropic_thinking_blocks(claude, forced):
    msgs = [{"role": "user", "content": uniq("2+2?")}]
    forced.arm(SCRIPT)
    r = claude.messages.create(model="m", max_tokens=64, messages=msgs,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == REASONING and r.content[1].text == CONTENT
    forced.arm(SCRIPT)
    kinds = []
    with claude.messages.stream(model="m", max_tokens=64, messages=msgs,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        for ev in s:
            if ev.type == "content_block_delta":
                kinds.append(ev.delta.type)
        final = s.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert kinds.index("text_delta") > max(i for i, k in enumerate(kinds) if k == "thinking_delta")
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[1].text == CONTENT


def test_anthropic_thinking_switches_the_template(srv, claude):
    from engine.step.request import encode_prompt
    msgs = [{"role": "user", "content": uniq()}]

    def n(kind):
        return claude.messages.count_tokens(model="m", messages=msgs,
                                            thinking={"type": kind, "budget_tokens": 1024}
                                            if kind == "enabled" else {"type": kind}).input_tokens
    assert n("enabled") == len(encode_prompt(srv.tokenizer, msgs, None, {"enable_thinking": True}))
    assert n("disabled") == len(encode_prompt(srv.tokenizer, msgs, None,
                                              {"enable_thinking": False}))


@pytest.mark.parametrize("thinking,param", [({"type": "sometimes"}, "thinking.type"),
                                            ({"type": "enabled", "budget_tokens": "x"},
                                             "thinking.budget_tokens"),
                                            ("yes", "thinking")])
def test_anthropic_bad_thinking_is_400(srv, thinking, param):
    import httpx
    r = httpx.post(srv.url + "/v1/messages", json={
        "model": "m", "max_tokens": 8, "thinking": thinking,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert param.split(".")[0] in r.json()["error"]["message"]


def test_responses_reasoning_item(oai, forced):
    forced.arm(SCRIPT)
    r = oai.responses.create(model="m", input=uniq("2+2?"), max_output_tokens=64)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == REASONING
    assert r.output_text == CONTENT
    forced.arm(SCRIPT)
    deltas, types = [], []
    with oai.responses.stream(model="m", input=uniq("2+2?"), max_output_tokens=64) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type == "response.reasoning_text.delta":
                deltas.append(ev.delta)
        final = s.get_final_response()
    assert "".join(deltas) == REASONING
    assert "response.reasoning_text.done" in types
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING and final.output_text == CONTENT
    # the reasoning item is left out of the prompt of a continued turn (no crash, no 400)
    forced.arm("ok")
    r2 = oai.responses.create(model="m", input="and 3+3?", previous_response_id=r.id,
                              max_output_tokens=8)
    assert r2.output_text == "ok"


def _serve(fixture: str):
    """A scripted server on `fixture`, one SSE write per token (the split is checked on
    the finest chunking), with its OpenAI and Anthropic clients."""
    from anthropic import Anthropic
    from openai import OpenAI

    from parity.fixtures.models import ensure_fixture
    from srv_helpers import start_server, stop_server
    s = start_server(ensure_fixture(fixture), forced=True, batch=1, stream_interval_ms=0)
    yield (s, OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=60),
           Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60))
    s.forced.disarm()
    stop_server(s)


@pytest.fixture(scope="module")
def minicpm5():
    """A MiniCPM5 checkpoint (model_type llama, recognised by its chat template)."""
    yield from _serve("minicpm5_llama")


@pytest.fixture(scope="module")
def gemma4():
    yield from _serve("gemma4_text")


def test_minicpm5_answers_without_thinking_unless_asked(minicpm5):
    from engine.step.request import encode_prompt
    s, client, _ = minicpm5
    msgs = [{"role": "user", "content": uniq()}]
    off = encode_prompt(s.tokenizer, msgs, None, {"enable_thinking": False})
    on = encode_prompt(s.tokenizer, msgs, None, {"enable_thinking": True})
    assert off != on
    s.forced.arm("plain")
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=16)
    assert r.usage.prompt_tokens == len(off) and r.choices[0].message.content == "plain"
    # asked to think: the prompt opens <think>, so the output starts inside reasoning
    s.forced.arm("mulling it over</think>\n\nthe answer")
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=32,
                                       extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": True}})
    assert r.usage.prompt_tokens == len(on)
    assert r.choices[0].message.model_extra["reasoning_content"] == "mulling it over"
    assert r.choices[0].message.content == "the answer"
    s.forced.arm("mulling it over</think>\n\nthe answer")
    parts = {"reasoning_content": "", "content": ""}
    for ch in client.chat.completions.create(
            model="m", messages=msgs, max_tokens=32, stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}}):
        d = ch.choices[0].delta
        parts["content"] += d.content or ""
        parts["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": "mulling it over", "content": "the answer"}


@pytest.mark.parametrize("proto", ["openai", "anthropic", "responses"])
def test_gemma4_thinking_channel(proto, gemma4):
    """Gemma 4's thinking channel (`<|channel>thought ... <channel|>`), per token."""
    s, oai, claude = gemma4
    script = "<|channel>thought\nchecking the sum<channel|>It is four."
    msgs = [{"role": "user", "content": uniq()}]
    for stream in (False, True):
        s.forced.arm(script)
        if proto == "openai":
            if stream:
                r, c = "", ""
                for ch in oai.chat.completions.create(model="m", messages=msgs, max_tokens=40,
                                                      stream=True):
                    d = ch.choices[0].delta
                    r += (d.model_extra or {}).get("reasoning_content") or ""
                    c += d.content or ""
            else:
                m = oai.chat.completions.create(model="m", messages=msgs,
                                                max_tokens=40).choices[0].message
                r, c = m.model_extra["reasoning_content"], m.content
        elif proto == "anthropic":
            kw = dict(model="m", max_tokens=40, messages=msgs)
            if stream:
                with claude.messages.stream(**kw) as st:
                    msg = st.get_final_message()
            else:
                msg = claude.messages.create(**kw)
            assert [b.type for b in msg.content] == ["thinking", "text"]
            r, c = msg.content[0].thinking, msg.content[1].text
        else:
            kw = dict(model="m", input=uniq(), max_output_tokens=40)
            if stream:
                with oai.responses.stream(**kw) as st:
                    resp = st.get_final_response()
            else:
                resp = oai.responses.create(**kw)
            assert [o.type for o in resp.output] == ["reasoning", "message"]
            r, c = resp.output[0].content[0].text, resp.output_text
        assert (r, c) == ("checking the sum", "It is four."), (proto, stream)

