"""server/tp.py in one process (a world of one rank, where a broadcast is the identity):
the messages rank 0 sends replay on a fresh engine to the same tokens, a follower that
gets other tokens stops, a step that hangs past --tp-timeout ends every request with a
503 in its protocol's shape and exits with status 3, and sampling requests get a seed."""

import dataclasses
import json
import threading
import time

import httpx
import mlx.core as mx
import pytest

from engine import SamplingParams
from engine.distributed import Follower, params_from_json, params_to_json
from parity.fixtures.models import ensure_fixture
from server import tp
from server.state import ServerConfig, build_state
from tests.distributed.drive import drive


@pytest.fixture(scope="module")
def model_dir():
    return ensure_fixture("llama", "float32", variant="tp2")


class Recorder:
    """engine.distributed.sharding.broadcast_json for the tests: rank 0 records, a follower
    replays."""

    def __init__(self, script=None):
        self.sent, self.script = [], list(script or ())

    def __call__(self, obj=None, group=None):
        if self.script:
            return self.script.pop(0)
        msg = json.loads(json.dumps(obj))   # what crosses the wire
        self.sent.append(msg)
        return msg


def _drive(leader, requests):
    """What the gateway does: submit, step until done (cancelling the last request after
    two steps); the token ids and finish reason per request."""
    rids = [leader.submit(ids, p) for ids, p in requests]
    return drive(leader, rids, cancel=rids[-1])


# the llama fixture's EOS ids (its config.json): the unseeded sampling request below draws its
# seed on rank 0 at random, and must not end early on a sampled EOS (seen once in ~20 runs)
NO_EOS = {1009: -100.0, 1016: -100.0, 1017: -100.0}
REQUESTS = [([1, 5, 9, 13], SamplingParams(max_tokens=6, temperature=0.0)),
            ([2, 4, 6], SamplingParams(max_tokens=5, temperature=0.9, logit_bias=NO_EOS)),
            ([7, 3], SamplingParams(max_tokens=4, temperature=0.7, seed=11,
                                    logit_bias={5: -3.0}, stop=["zz"])),
            ([8, 8, 8], SamplingParams(max_tokens=50, temperature=0.0))]   # cancelled


def _state(model_dir, **kw):
    return build_state(ServerConfig(model=model_dir, **{
        "tensor_parallel": True, "batch": 2, "prompt_cache_bytes": 0, **kw}))


@pytest.mark.parametrize("lane", [{"batch": 2}, {"batch": 1, "prompt_cache_bytes": 1 << 24},
                                  {"batch": 2, "kv_quant": "8"}], ids=["batch", "solo", "kv8"])
def test_follower_replays_rank_0_and_stops_out_of_step(model_dir, monkeypatch, capsys, lane):
    import engine.distributed.sharding
    lead_state = _state(model_dir, **lane)
    rec = Recorder()
    monkeypatch.setattr(engine.distributed.sharding, "broadcast_json", rec)
    leader = tp.Leader(lead_state, timeout=30)
    tokens = lead_state.gateway.call_sync(_drive, leader, REQUESTS)
    lead_state.gateway.call_sync(leader.send_stop)
    leader.dog.stop()
    assert all(t for t, _ in tokens[:3]) and rec.sent[-1]["kind"] == "stop"
    assert [e for _, e in tokens] == ["length", "length", "length", "cancelled"]
    subs = [op for m in rec.sent for op in m["ops"] if op["kind"] == "submit"]
    # the unseeded sampling request went out with a seed rank 0 drew; greedy ones stay as sent
    assert [s["params"]["seed"] is not None for s in subs] == [False, True, True, False]
    assert subs[2]["params"]["seed"] == 11
    assert params_from_json(subs[2]["params"]) == REQUESTS[2][1]
    lead_state.gateway.close()

    def follow(script):
        st = _state(model_dir, **lane)
        monkeypatch.setattr(engine.distributed.sharding, "broadcast_json", Recorder(script))
        try:
            return st.gateway.call_sync(lambda: Follower(st.engine, timeout=30).run())
        finally:
            st.gateway.close()

    assert follow(rec.sent) == 0        # every step's tokens checked against rank 0's
    bad = json.loads(json.dumps(rec.sent))
    check = next(m["check"] for m in bad if any(c[1] for c in m["check"]))
    row = next(c for c in check if c[1])
    row[1][0] += 1
    capsys.readouterr()
    assert follow(bad) == tp.EXIT_RANK_LOST
    assert "OutOfStep: rank 0's step gave" in capsys.readouterr().err


class Hang:
    """A model whose forward blocks while `stuck` is set (a rank that stopped answering)."""

    def __init__(self, model, tok):
        object.__setattr__(self, "_inner", model)
        object.__setattr__(self, "stuck", threading.Event())
        object.__setattr__(self, "release", threading.Event())

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *a, **kw):
        if self.stuck.is_set():
            self.release.wait(30)
        return self._inner(*a, **kw)


def test_hung_step_answers_503_and_exits(model_dir):
    from server.app import create_app
    from server.cli import BackgroundServer

    state = build_state(ServerConfig(model=model_dir, tensor_parallel=True, batch=2),
                        wrap_model=Hang)
    app = create_app(state)
    bg = BackgroundServer(app)
    leader = tp.lead(state, 4.0, app, bg.server)
    exits = []
    leader.grace, leader.exit = (1.5, 0.2), exits.append
    bg.start()
    try:
        r = httpx.post(bg.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        res = {}

        def ask(path, body):
            r = httpx.post(bg.url + path, json=body, timeout=30)
            res[path] = (r.status_code, r.json())
        state.model.stuck.set()
        t0 = time.monotonic()
        ts = [threading.Thread(target=ask, args=a) for a in (
            ("/v1/completions", {"prompt": "hello", "max_tokens": 50}),
            ("/v1/messages", {"model": "m", "max_tokens": 50,
                              "messages": [{"role": "user", "content": "hi"}]}))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert time.monotonic() - t0 < 4.0 + 4
        code, body = res["/v1/completions"]
        assert code == 503 and body["error"]["type"] == "overloaded_error"
        assert "lost a tensor-parallel rank" in body["error"]["message"]
        code, body = res["/v1/messages"]
        assert code == 503 and body["type"] == "error"
        assert body["error"]["type"] == "overloaded_error"
        # a new request while the server goes down: 503 too
        r = httpx.post(bg.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        for _ in range(50):
            if exits:
                break
            time.sleep(0.1)
        assert exits == [tp.EXIT_RANK_LOST] and bg.server.should_exit
    finally:
        state.model.release.set()
        bg.stop()
        state.gateway.close()


def test_leader_refuses_what_ranks_cannot_replay(model_dir):
    state = _state(model_dir)
    leader = tp.Leader(state, timeout=30)
    try:
        grammar = SamplingParams(processor_factories=(lambda: None,))
        with pytest.raises(ValueError, match="structured outputs"):
            state.gateway.call_sync(leader.submit, [1, 2], grammar)
        with pytest.raises(ValueError, match="adapters"):
            state.gateway.call_sync(leader.submit, [1, 2], SamplingParams(), adapter=("a",))
    finally:
        leader.dog.stop()
        state.gateway.close()


def test_params_cross_as_json():
    p = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=2 ** 64 - 1,
                       logit_bias={3: 1.5}, stop=("a", "b"), logprobs=True, top_logprobs=2)
    d = json.loads(json.dumps(params_to_json(p)))
    assert params_from_json(d) == p
    assert set(d) == {f.name for f in dataclasses.fields(p)} - {"processor_factories"}
    mx.synchronize()


def test_idle_heartbeat_and_silent_rank_0(model_dir, monkeypatch, capsys):
    """Idle, rank 0 sends a heartbeat every --tp-timeout/4 s; a follower that hears
    nothing for --tp-timeout s says so and exits with status 3."""
    import engine.distributed.sharding
    from server.app import create_app
    from server.cli import uvicorn_server

    rec = Recorder()
    monkeypatch.setattr(engine.distributed.sharding, "broadcast_json", rec)
    state = _state(model_dir)
    app = create_app(state)
    leader = tp.lead(state, 0.4, app, uvicorn_server(app))
    try:
        time.sleep(0.7)
        assert sum(m["kind"] == "ping" for m in rec.sent) >= 3
    finally:
        leader.dog.stop()
        state.gateway.close()

    silent = threading.Event()
    monkeypatch.setattr(engine.distributed.sharding, "broadcast_json",
                        lambda *a, **k: silent.wait(10))
    st = _state(model_dir)
    exits = []
    try:
        follower = Follower(st.engine, timeout=0.5)
        follower.exit = exits.append
        threading.Thread(target=follower.run, daemon=True).start()
        time.sleep(1.2)
        assert exits == [tp.EXIT_RANK_LOST]
        assert "rank 0 lost: no answer within 0.5 s (waiting for rank 0)" in capsys.readouterr().err
    finally:
        silent.set()
        st.gateway.close()
