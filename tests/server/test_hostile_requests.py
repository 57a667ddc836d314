"""Hostile requests against the request path: a prompt longer than the model's context,
a client that leaves during prefill, floods beyond the queue bound, a poison row.
Each case answers quickly in the protocol's own error shape (or ends quickly), and a
normal request succeeds right after it (qwen3 fixture, context 4,096 tokens)."""

import time
import uuid

import httpx
import pytest

from srv_helpers import start_server, stop_server, stream_chat_text

BOUND_S = 3.0
LONG = "a " * 4200          # ~4,200 tokens: over the fixture's 4,096-token context


@pytest.fixture(scope="module")
def rs(qwen_dir):
    s = start_server(qwen_dir, max_tokens=8, temperature=0.0, prompt_cache_bytes=0, batch=2,
                     prefill_step_size=64)
    yield s
    stop_server(s)


def post(s, path, body, timeout=30.0):
    t0 = time.monotonic()
    r = httpx.post(s.url + path, json=body, timeout=timeout)
    r.elapsed_s = time.monotonic() - t0
    return r


def normal(s):
    r = post(s, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": f"hi {uuid.uuid4().hex[:6]}"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    return r


def error_of(r, path):
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        return body["error"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


CASES = [("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}],
                                   "max_tokens": 2}),
         ("/v1/completions", {"prompt": LONG, "max_tokens": 2}),
         ("/v1/responses", {"input": LONG, "max_output_tokens": 2}),
         ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": LONG}]})]


@pytest.mark.parametrize("path,body", CASES, ids=[c[0] for c in CASES])
def test_context_length_exceeded_is_400_before_compute(rs, path, body):
    steps = rs.state.engine.stats()["steps"]
    r = post(rs, path, body)
    assert r.status_code == 400, r.text[:300]
    assert r.elapsed_s < BOUND_S
    err = error_of(r, path)
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"
    assert "4096" in err["message"]
    assert rs.state.engine.stats()["steps"] == steps      # nothing ran
    normal(rs)


def test_engine_submit_refuses_over_context(qwen_dir):
    import engine
    from engine import Engine, SamplingParams
    from engine.step.request import ContextLengthExceeded

    model, tok = engine.load(qwen_dir)
    eng = Engine(model, tok)
    ids = tok.encode(LONG)
    assert len(ids) >= 4096
    with pytest.raises(ContextLengthExceeded) as ei:
        eng.submit(ids, SamplingParams(max_tokens=1))
    assert isinstance(ei.value, ValueError) and ei.value.limit == 4096
    assert "4096" in str(ei.value) and not eng.has_unfinished()
    eng.submit(ids[:4095], SamplingParams(max_tokens=1))    # one token of room: accepted


class Counting:
    """A model wrapper counting forward calls (and sleeping `delay` s per prefill chunk)."""

    def __init__(self, model, tokenizer=None, delay: float = 0.0):
        self._inner, self.calls, self.delay = model, 0, delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, inputs, cache=None, **kw):
        self.calls += 1
        if self.delay and inputs.shape[-1] > 1:
            time.sleep(self.delay)
        return self._inner(inputs, cache=cache, **kw)


@pytest.mark.parametrize("max_batch", [1, 2], ids=["solo", "batch"])
def test_engine_abort_lands_between_prefill_chunks(qwen_dir, max_batch):
    import engine
    from engine import Engine, SamplingParams

    model, tok = engine.load(qwen_dir)
    m = Counting(model)
    eng = Engine(m, tok, max_batch=max_batch, prefill_step_size=64)
    ids = tok.encode("a " * 2000)[:2000]            # 31 chunks of 64 tokens
    rid = eng.submit(ids, SamplingParams(max_tokens=4))
    assert eng.step() == []                          # one step: one chunk, no token yet
    assert m.calls == 1
    assert eng.abort(rid)
    outs = eng.step()
    assert [o.finish_reason for o in outs] == ["cancelled"] and m.calls <= 2
    assert not eng.has_unfinished()
    # and the engine serves the next request normally
    rid = eng.submit(tok.encode("hello there"), SamplingParams(max_tokens=3))
    got = []
    while eng.has_unfinished():
        got += eng.step()
    assert got[-1].finish_reason == "length" and sum(o.generation_tokens > 0 for o in got)


@pytest.mark.parametrize("batch", [1, 2], ids=["solo", "batch"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_client_leaving_during_prefill_frees_the_worker(qwen_dir, batch, stream):
    """A ~4,000-token prompt prefilled in 64-token chunks of 0.1 s each (~6 s); the
    client leaves after 0.5 s; a normal request right after is served within 2 s."""
    from server.app import create_app, security_for
    from server.cli import BackgroundServer
    from server.state import ServerConfig, build_state

    cfg = ServerConfig(model=str(qwen_dir), max_tokens=8, temperature=0.0, batch=batch,
                       prompt_cache_bytes=0, prefill_step_size=64)
    state = build_state(cfg, wrap_model=lambda m, t: Counting(m, t, delay=0.1))
    bg = BackgroundServer(create_app(state, security_for(cfg))).start()
    s = type("S", (), {"url": bg.url, "state": state})()
    try:
        body = {"messages": [{"role": "user", "content": "a " * 3900}], "max_tokens": 4,
                "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body,
                              timeout=0.5) as r:
                for _ in r.iter_lines():
                    pass
        t0 = time.monotonic()
        normal(s)
        assert time.monotonic() - t0 < 2.0
        assert state.gateway.stats()["cancelled"] == 1
    finally:
        bg.stop()
        state.gateway.close()


def test_engine_hands_at_most_max_batch_rows_to_the_batch(qwen_dir):
    import engine
    from engine import Engine, SamplingParams

    model, tok = engine.load(qwen_dir)
    eng = Engine(model, tok, max_batch=2)
    for i in range(5):
        eng.submit(tok.encode(f"row {i} says"), SamplingParams(max_tokens=4))
    eng.step()
    st = eng.stats()
    assert st["active_rows"] == 2 and st["waiting"] == 3     # the rest wait, and are counted
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
        assert eng.stats()["active_rows"] <= 2
    assert len(done) == 5 and eng.stats()["peak_rows"] == 2
    assert all(o.finish_reason == "length" for o in done)


@pytest.mark.parametrize("batch", [1, 2], ids=["solo", "batch"])
def test_one_bounded_queue_for_both_lanes(qwen_dir, batch):
    """The worker is held busy; of 7 concurrent requests, `--max-queue 3` are admitted
    (and served once it is free), the other 4 get a quick 503 + Retry-After in their
    protocol's shape; at most `--batch` rows ever decode; a normal request works after."""
    import concurrent.futures as cf

    s = start_server(qwen_dir, max_tokens=4, temperature=0.0, batch=batch,
                     prompt_cache_bytes=0, max_queue=3)
    try:
        assert s.state.max_queue == 3
        hold = s.state.gateway.call(time.sleep, 2.0)     # the worker is busy for 2 s
        time.sleep(0.1)
        paths = ["/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/responses"]
        bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 4},
                  "/v1/messages": {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 4},
                  "/v1/completions": {"prompt": "hi", "max_tokens": 4},
                  "/v1/responses": {"input": "hi", "max_output_tokens": 4}}
        order = [paths[i % 4] for i in range(7)]
        with cf.ThreadPoolExecutor(7) as ex:
            futs = []
            for p in order:                       # in order: the first three get in
                futs.append(ex.submit(post, s, p, bodies[p]))
                time.sleep(0.05)
            rs = [f.result() for f in futs]
        hold.result()
        ok = [r for r in rs if r.status_code == 200]
        busy = [(p, r) for p, r in zip(order, rs) if r.status_code == 503]
        assert len(ok) == 3 and len(busy) == 4, [r.status_code for r in rs]
        for p, r in busy:
            assert r.headers["retry-after"] == "1" and r.elapsed_s < BOUND_S
            err = error_of(r, p)
            assert err["type"] == "overloaded_error" and "at capacity" in err["message"]
        assert s.state.engine.stats()["peak_rows"] <= batch
        assert s.state.stats()["batch"]["rejected"] == 4
        normal(s)
    finally:
        stop_server(s)


class Boom(RuntimeError):
    pass


def _raising_processor(after: int):
    calls = []

    def proc(tokens, logits):
        calls.append(1)
        if len(calls) > after:
            raise Boom("a processor of this row failed")
        return logits
    return proc


def _building_fails():
    raise Boom("this row's processor cannot be built")


@pytest.mark.parametrize("max_batch", [1, 3], ids=["solo", "batch"])
def test_a_failing_row_fails_alone(qwen_dir, max_batch):
    """Of four requests decoding together, one whose processor raises on its 3rd step and
    one whose processor cannot be built end with finish_reason "error" (their exception
    attached); the two innocent ones run to max_tokens."""
    import engine
    from engine import Engine, SamplingParams

    model, tok = engine.load(qwen_dir)
    eng = Engine(model, tok, max_batch=max_batch)
    p = SamplingParams(max_tokens=12, logit_bias={i: -100 for i in tok.eos_token_ids})
    a = eng.submit(tok.encode("innocent one"), p)
    b = eng.submit(tok.encode("poison"), SamplingParams(
        max_tokens=12, processor_factories=(lambda: _raising_processor(2),)))
    c = eng.submit(tok.encode("innocent two"), p)
    d = eng.submit(tok.encode("unbuildable"), SamplingParams(
        max_tokens=12, processor_factories=(_building_fails,)))
    last = {}
    n = {}
    while eng.has_unfinished():
        for o in eng.step():
            n[o.request_id] = n.get(o.request_id, 0) + len(o.token_ids)
            if o.finished:
                last[o.request_id] = o
    assert last[a].finish_reason == last[c].finish_reason == "length"
    assert n[a] == n[c] == 12
    assert last[b].finish_reason == "error" and isinstance(last[b].error, Boom)
    assert last[d].finish_reason == "error" and isinstance(last[d].error, Boom)
    assert not last[d].started and n.get(d, 0) == 0
    assert eng.stats()["active_rows"] == 0 and not eng.has_unfinished()


def _idle(s, within: float) -> float:
    t0 = time.monotonic()
    while s.state.engine.has_unfinished() or s.state.gateway.queued:
        assert time.monotonic() - t0 < within, "the generation is still running"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("fault", ["client", "server"])
def test_error_after_queueing_cancels_the_job(rs, monkeypatch, fault):
    """The route fails after its job was queued (here: rendering the Responses stream
    head; a 400 for a client error, a 500 for a fault): a quick answer in the OpenAI
    shape, the job is cancelled at once instead of running to max_output_tokens unread
    (the client's connection stays open meanwhile), and a normal request works after."""
    from server import responses
    from server.errors import APIError

    def broken(self):
        if fault == "client":
            raise APIError(400, "tool_choice cannot be rendered", param="tool_choice")
        raise RuntimeError("renderer fault")
    monkeypatch.setattr(responses.ResponseRender, "head", broken)
    _idle(rs, 10)
    before = rs.state.gateway.stats()
    with httpx.Client(timeout=30) as client:
        t0 = time.monotonic()
        r = client.post(rs.url + "/v1/responses", json={
            "input": "tell me a long story", "stream": True, "max_output_tokens": 3000,
            "logit_bias": {str(i): -100 for i in rs.state.tokenizer.eos_token_ids}})
        assert time.monotonic() - t0 < BOUND_S
        err = error_of(r, "/v1/responses")
        if fault == "client":
            assert r.status_code == 400 and err["param"] == "tool_choice"
        else:
            assert r.status_code == 500 and err["type"] == "server_error"
            assert "renderer" not in err["message"]
        _idle(rs, 1.0)
        after = rs.state.gateway.stats()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]
    monkeypatch.undo()
    normal(rs)


def test_plain_responses_turn_not_stored_when_its_answer_failed(rs, monkeypatch):
    """A non-streamed Responses turn whose body cannot be sent (a lone surrogate in it)
    is a 500, and the turn is not stored; a normal stored turn still is."""
    from server import responses

    real = responses.ResponseRender.result

    def with_surrogate(self, done):
        return {**real(self, done), "metadata": {"x": "\ud800"}}
    entries = rs.state.store.stats()["entries"]
    monkeypatch.setattr(responses.ResponseRender, "result", with_surrogate)
    r = post(rs, "/v1/responses", {"input": "hi", "max_output_tokens": 3})
    assert r.status_code == 500 and r.elapsed_s < BOUND_S
    assert rs.state.store.stats()["entries"] == entries
    monkeypatch.undo()
    r = post(rs, "/v1/responses", {"input": "hi", "max_output_tokens": 3})
    assert r.status_code == 200 and rs.state.store.stats()["entries"] == entries + 1
    normal(rs)


def test_lone_surrogate_tool_choice_leaves_nothing_running(rs):
    """The reproduction: a lone surrogate in Responses `tool_choice.name` on a stream of up
    to 20,000 tokens: a quick 4xx/5xx in the OpenAI shape, nothing left running."""
    body = ('{"input": "hi", "stream": true, "max_output_tokens": 3000, "tools": [{"type": '
            '"function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": '
            '{"type": "function", "name": "\\ud800"}}')
    t0 = time.monotonic()
    r = httpx.post(rs.url + "/v1/responses", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert time.monotonic() - t0 < BOUND_S
    assert r.status_code == 400 and "surrogate" in error_of(r, "/v1/responses")["message"]
    _idle(rs, 1.0)
    normal(rs)


def test_failing_row_leaves_innocent_streams_untouched(rs, monkeypatch):
    """Two streams decode together on `--batch 2`; a request whose processor raises on
    its 3rd step (an internal fault standing in for any per-row failure) joins them: it
    gets an error, and both streams yield exactly the text they give alone."""
    import threading

    from server import chat

    bias = {str(i): -100 for i in rs.state.tokenizer.eos_token_ids}
    prompts = ["innocent one", "innocent two"]
    alone = [stream_chat_text(rs.url, p, 24, logit_bias=bias) for p in prompts]
    real = chat.processor_factories

    def poisoned(state, call):
        text = str(call.messages or call.prompt)
        return (lambda: _raising_processor(2),) if "poison" in text else real(state, call)
    monkeypatch.setattr(chat, "processor_factories", poisoned)
    got = [None, None]

    def run(i):
        got[i] = stream_chat_text(rs.url, prompts[i], 24, logit_bias=bias)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    r = post(rs, "/v1/chat/completions", {"messages": [{"role": "user", "content": "poison"}],
                                          "max_tokens": 24})
    for t in threads:
        t.join()
    assert r.status_code in (400, 500) and r.elapsed_s < BOUND_S
    assert error_of(r, "/v1/chat/completions")["message"]
    assert got == alone
    monkeypatch.undo()
    normal(rs)
