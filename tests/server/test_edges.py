"""Edges of the wire formats: mid-generation server faults on every protocol,
server-side defaults (--max-tokens, --thinking), multi-byte streaming, the
Responses `store: false`, and per-protocol error shapes for 404/405/413."""


import anthropic
import httpx
import openai
import pytest

from srv_helpers import NO_EOS, sse_events, uniq

@pytest.fixture
def faulty(srv, monkeypatch):
    """The engine's token loop raises after its third token (a server fault mid-generation)."""
    import engine.step.alone
    real = engine.step.alone.generate_step

    def failing(*a, **kw):
        for i, step in enumerate(real(*a, **kw)):
            yield step
            if i == 2:
                raise RuntimeError("injected fault")
    before = httpx.get(srv.url + "/stats").json()["queue"]["failed"]
    monkeypatch.setattr(engine.step.alone, "generate_step", failing)
    yield srv
    monkeypatch.undo()
    after = httpx.get(srv.url + "/stats").json()["queue"]["failed"]
    assert after > before


def _body(n=20):
    return {"max_tokens": n, "temperature": 0, "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": uniq()}]}


def _still_serving(srv):
    r = httpx.post(srv.v1 + "/chat/completions", json={**_body(2)}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_fault_mid_chat_stream_is_an_error_frame(faulty, oai):
    r = httpx.post(faulty.v1 + "/chat/completions", json={**_body(), "stream": True},
                   timeout=30)
    assert r.status_code == 200
    evs = sse_events(r.text)
    assert evs[-1] == (None, "[DONE]")
    err = evs[-2][1]["error"]
    assert err["type"] == "server_error" and "injected fault" in err["message"]
    assert "Traceback" not in r.text
    assert "choices" in evs[0][1]                      # content streamed before the fault
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in oai.chat.completions.create(model="m", stream=True, **_body()):
            pass
    # non-streaming: a 500 with the OpenAI shape
    r = httpx.post(faulty.v1 + "/chat/completions", json=_body(), timeout=30)
    assert r.status_code == 500
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert r.json()["error"]["type"] == "server_error"
    r = httpx.post(faulty.v1 + "/completions", json={"prompt": uniq(), "max_tokens": 20,
                                                     "logit_bias": NO_EOS, "stream": True})
    assert sse_events(r.text)[-2][1]["error"]["type"] == "server_error"


def test_fault_mid_anthropic_stream_is_an_error_event(faulty, claude):
    body = {**_body(), "stream": True}
    r = httpx.post(faulty.v1 + "/messages", json=body, timeout=30)
    assert r.status_code == 200
    evs = sse_events(r.text)
    assert evs[0][0] == "message_start" and evs[-1][0] == "error"
    assert evs[-1][1] == {"type": "error", "error": {
        "type": "api_error", "message": evs[-1][1]["error"]["message"]}}
    assert "injected fault" in evs[-1][1]["error"]["message"]
    assert "message_stop" not in [n for n, _ in evs]
    with pytest.raises(anthropic.APIStatusError, match="injected fault"):
        with claude.messages.stream(model="x", max_tokens=20, messages=body["messages"],
                                    extra_body={"temperature": 0, "logit_bias": NO_EOS}) as s:
            for _ in s:
                pass
    r = httpx.post(faulty.v1 + "/messages", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 500 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "api_error"


def test_fault_mid_responses_stream_is_response_failed(faulty):
    body = {"input": uniq(), "max_output_tokens": 20, "temperature": 0, "logit_bias": NO_EOS,
            "stream": True}
    evs = sse_events(httpx.post(faulty.v1 + "/responses", json=body, timeout=30).text)
    names = [n for n, _ in evs]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-2:] == ["response.failed", "error"]
    failed = evs[-2][1]["response"]
    assert failed["status"] == "failed" and "injected fault" in failed["error"]["message"]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    r = httpx.post(faulty.v1 + "/responses", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_serving_continues_after_faults(srv):
    _still_serving(srv)


def test_server_max_tokens_default(srv, oai, claude):
    cfg = srv.state.config
    old = cfg.max_tokens
    cfg.max_tokens = 3                      # = engine-serve --max-tokens 3
    try:
        body = _body()
        del body["max_tokens"]
        r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=30).json()
        assert r["usage"]["completion_tokens"] == 3
        assert r["choices"][0]["finish_reason"] == "length"
        r = oai.responses.create(model="x", input=uniq(), temperature=0,
                                 extra_body={"logit_bias": NO_EOS})
        assert r.usage.output_tokens == 3 and r.status == "incomplete"
        r = oai.completions.create(model="x", prompt=uniq(), temperature=0,
                                   logit_bias=NO_EOS)
        assert r.usage.completion_tokens == 3
        # a request value still wins
        r = oai.chat.completions.create(model="m", temperature=0, max_tokens=5,
                                        logit_bias=NO_EOS, messages=body["messages"])
        assert r.usage.completion_tokens == 5
    finally:
        cfg.max_tokens = old


def test_server_thinking_default_and_request_override(srv, oai, claude):
    from engine.step.generation import encode_prompt
    msgs = [{"role": "user", "content": uniq()}]
    n = lambda kw: len(encode_prompt(srv.tokenizer, msgs, None, kw))
    assert n({"enable_thinking": False}) != n({"enable_thinking": True})
    cfg = srv.state.config
    old = cfg.thinking
    cfg.thinking = False                    # = engine-serve --thinking false
    try:
        r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == n({"enable_thinking": False})
        r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0,
                                        extra_body={"chat_template_kwargs":
                                                    {"enable_thinking": True}})
        assert r.usage.prompt_tokens == n({"enable_thinking": True})
        m = claude.messages.create(model="x", max_tokens=1, messages=msgs,
                                   extra_body={"temperature": 0})
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == \
            n({"enable_thinking": False})
        r = oai.responses.create(model="x", input=msgs[0]["content"], max_output_tokens=1,
                                 temperature=0, reasoning={"effort": "high"})
        assert r.usage.input_tokens == n({"enable_thinking": True})
    finally:
        cfg.thinking = old


TEXT = "héllo 日本語 🎉 ok"


@pytest.mark.parametrize("path", ["/chat/completions", "/messages", "/responses"])
def test_multibyte_text_is_held_until_decodable(srv, forced, path):
    # the fixture tokenizer splits every non-ASCII character across byte tokens
    ids = forced.arm(TEXT)
    assert len(ids) > len(TEXT.encode("ascii", "ignore").split()) + 5
    user = [{"role": "user", "content": uniq()}]
    body = {"/chat/completions": {"messages": user, "max_tokens": 60},
            "/messages": {"messages": user, "max_tokens": 60},
            "/responses": {"input": uniq(), "max_output_tokens": 60}}[path]
    body.update(temperature=0, stream=True)
    evs = sse_events(httpx.post(srv.v1 + path, json=body, timeout=30).text)
    if path == "/chat/completions":
        parts = [d["choices"][0]["delta"].get("content") or "" for _, d in evs[:-1]]
    elif path == "/messages":
        parts = [d["delta"]["text"] for n, d in evs if n == "content_block_delta"]
    else:
        parts = [d["delta"] for n, d in evs if n == "response.output_text.delta"]
    assert "".join(parts) == TEXT
    assert not any("\ufffd" in p for p in parts)


def test_responses_store_false_is_not_resumable(srv, oai):
    r = oai.responses.create(model="x", input=uniq(), max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="x", input="more", previous_response_id=r.id,
                             max_output_tokens=2)
    kept = oai.responses.create(model="x", input=uniq(), max_output_tokens=2)
    assert kept.store is True
    nxt = oai.responses.create(model="x", input="more", previous_response_id=kept.id,
                               max_output_tokens=2)
    assert nxt.previous_response_id == kept.id
    # a store=false response cannot be retrieved either; a stored one can
    r = httpx.get(srv.v1 + f"/responses/{r.id}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert oai.responses.retrieve(kept.id).id == kept.id


def test_server_sampling_defaults(srv, oai):
    # --temperature 1 --top-k 1 is greedy whatever the seed; a request value still wins
    cfg = srv.state.config
    old = cfg.temperature, cfg.top_k, cfg.top_p
    cfg.temperature, cfg.top_k, cfg.top_p = 1.0, 1, 1.0
    msgs = [{"role": "user", "content": uniq()}]
    try:
        got = [oai.chat.completions.create(model="m", messages=msgs, max_tokens=8, seed=s)
               .choices[0].message.content for s in (1, 2)]
        ref = srv.generate(msgs, max_tokens=8, temperature=0.0)
        assert got == [ref.text, ref.text]
        r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=8, seed=3,
                                        extra_body={"top_k": 0}, top_p=0.95)
        assert r.choices[0].message.content == srv.generate(
            msgs, max_tokens=8, temperature=1.0, top_k=0, top_p=0.95, seed=3).text
    finally:
        cfg.temperature, cfg.top_k, cfg.top_p = old
