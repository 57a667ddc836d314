"""Hostile requests against the request path: a prompt longer than the model's context,
a client that leaves during prefill, floods beyond the queue bound, a poison row.
Each case answers quickly in the protocol's own error shape (or ends quickly), and a
normal request succeeds right after it (qwen3 fixture, context 4,096 tokens)."""

import time
import uuid

import httpx
import pytest

from srv_helpers import start_server, stop_server

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
    from engine.request import ContextLengthExceeded

    model, tok = engine.load(qwen_dir)
    eng = Engine(model, tok)
    ids = tok.encode(LONG)
    assert len(ids) >= 4096
    with pytest.raises(ContextLengthExceeded) as ei:
        eng.submit(ids, SamplingParams(max_tokens=1))
    assert isinstance(ei.value, ValueError) and ei.value.limit == 4096
    assert "4096" in str(ei.value) and not eng.has_unfinished()
    eng.submit(ids[:4095], SamplingParams(max_tokens=1))    # one token of room: accepted
