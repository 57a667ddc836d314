"""Body structure bounded before parsing, and max_tokens bounded by the context.

- A body of many empty objects in an unknown field is refused on its raw bytes
  (413 naming --max-json-nodes) before `json.loads` ever sees it.
- `max_tokens` beyond the context the prompt leaves is capped at the context left, on every
  route (chat, completions, messages, responses) and in the library: generation never runs
  past the model's positions, and agent clients that ask 32,000 tokens of any model work.
"""

from __future__ import annotations

import json

import httpx
import pytest

from srv_helpers import NO_EOS, uniq


def test_many_values_refused_before_json_parsing(srv, monkeypatch):
    import server.limits as limits
    parsed = []
    real = json.loads

    class Spy:
        def __getattr__(self, name):
            return getattr(json, name)

        @staticmethod
        def loads(raw, *a, **k):
            parsed.append(len(raw))
            return real(raw, *a, **k)
    monkeypatch.setattr(limits, "json", Spy())
    # 300,000 empty objects (900 KB): over the default limit (100,000 for this model)
    body = (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
            b'"junk": [' + b"{}," * 300_000 + b'{}]}')
    r = httpx.post(srv.v1 + "/chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert "--max-json-nodes" in r.json()["error"]["message"]
    assert parsed == [], "the body was parsed before it was refused"


def test_json_shape_counts_values_outside_strings():
    from server.limits import json_shape
    # (an upper bound while under the limit; exact, strings removed, near it)
    assert json_shape(b'{"a": [1, 2, {"b": "x,y,[{"}]}', 4) == (6, 3)
    assert json_shape(b'[' + b'{},' * 1000 + b'{}]', 100)[0] > 100
    # commas inside strings alone never refuse a body under the limit
    assert json_shape(b'{"t": "' + b"," * 150 + b'"}', 100) == (2, 1)


def _ctx(srv):
    return srv.state.engine.max_context


def _too_many(srv):
    return _ctx(srv) + 10


ROUTES = {
    "chat": ("/v1/chat/completions", lambda n: {
        "model": "m", "max_tokens": n, "messages": [{"role": "user", "content": uniq()}]}),
    "completions": ("/v1/completions", lambda n: {
        "model": "m", "max_tokens": n, "prompt": uniq()}),
    "messages": ("/v1/messages", lambda n: {
        "model": "m", "max_tokens": n, "messages": [{"role": "user", "content": uniq()}]}),
    "responses": ("/v1/responses", lambda n: {
        "model": "m", "max_output_tokens": n, "input": uniq()}),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_max_tokens_beyond_context_is_capped_at_the_context_left(srv, route):
    """The cap the server queues is the context the prompt leaves; the answer succeeds."""
    path, body = ROUTES[route]
    seen = []
    gw = srv.state.gateway
    submit = gw.submit

    def spy(job):
        seen.append((len(job.prompt), job.params.max_tokens))
        return submit(job)
    gw.submit = spy
    try:
        r = httpx.post(srv.url + path, json=body(_too_many(srv)), timeout=120)
    finally:
        gw.submit = submit
    assert r.status_code == 200, r.text[:300]
    assert len(seen) == 1
    prompt, cap = seen[0]
    assert cap == _ctx(srv) - prompt and cap < _too_many(srv)


def test_library_caps_max_tokens_at_the_context_left(srv):
    import mlx.core as mx  # noqa: F401  (the engine runs on the worker)

    from engine import Engine, SamplingParams

    def run():
        eng = Engine(srv.model, srv.tokenizer, max_context=40)
        bias = {int(k): v for k, v in NO_EOS.items()}
        rid = eng.submit("hello there", SamplingParams(max_tokens=1_000_000, logit_bias=bias))
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.request_id == rid]
        return outs[-1]
    last = srv.on_worker(run)
    assert last.finish_reason == "length"
    assert last.prompt_tokens + last.generation_tokens == 40
