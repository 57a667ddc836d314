"""server/tp.py's Leader when a stop signal and a lost rank meet, in one process with a
stand-in engine (no model, no ring): after SIGTERM a step that fails or hangs past the
shutdown grace ends the in-flight requests with the 503 "lost a tensor-parallel rank"
error, never as cancelled; with healthy steps they run to their end. A collective's
error during a step is a lost rank, whatever the order."""

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from engine import SamplingParams
from engine.step.request import RequestOutput
from server import tp
from server.gateway import Gateway, GenerationJob

PEER_GONE = "[ring] connection to a peer was lost"


@dataclass
class _Req:
    left: int
    made: int = 0
    aborted: bool = False


class FakeEngine:
    """One token per request per step; `fault` makes every running request end with that
    error (what engine.step.core does when the forward raises); `hang` blocks the step."""

    def __init__(self):
        self.tokenizer = object()
        self.reqs: dict = {}
        self.fault = None
        self.hang = threading.Event()
        self.release = threading.Event()
        self.steps = 0

    def submit(self, ids, params, request_id=None):
        self.reqs[request_id] = _Req(params.max_tokens)
        return request_id

    def abort(self, request_id) -> bool:
        req = self.reqs.get(str(request_id))
        if req is not None:
            req.aborted = True
        return req is not None

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def idle(self):
        self.idles = getattr(self, "idles", 0) + 1
        return False

    def step(self) -> list:
        self.steps += 1
        if self.hang.is_set():
            self.release.wait(20)
        time.sleep(0.01)
        outs = []
        for rid, req in list(self.reqs.items()):
            if req.aborted:
                out = RequestOutput("", [], finish_reason="cancelled", request_id=rid)
            elif self.fault is not None:
                out = RequestOutput("", [], finish_reason="error", request_id=rid,
                                    error=self.fault)
            else:
                req.made += 1
                out = RequestOutput("a", [1], request_id=rid, generation_tokens=req.made,
                                    finish_reason="length" if req.made >= req.left else None)
            if out.finished:
                del self.reqs[rid]
            outs.append(out)
        return outs


@dataclass
class Rig:
    engine: FakeEngine
    gateway: Gateway
    leader: "tp.Leader"
    sent: list = field(default_factory=list)
    exits: list = field(default_factory=list)


@pytest.fixture
def rig(monkeypatch):
    import engine.distributed.sharding
    eng = FakeEngine()
    gw = Gateway("tp-stop-test")
    r = Rig(eng, gw, None)

    def broadcast(obj=None, group=None):
        r.sent.append(obj["kind"])
        return obj
    monkeypatch.setattr(engine.distributed.sharding, "broadcast_json", broadcast)
    monkeypatch.setattr(tp, "SHUTDOWN_GRACE_S", 0.5)

    class State:
        pass
    state = State()
    state.engine, state.gateway = eng, gw
    leader = tp.Leader(state, timeout=30)
    leader.grace, leader.exit = (0.05, 0.05), r.exits.append
    gw.engine = leader
    r.leader = leader
    try:
        yield r
    finally:
        eng.release.set()
        leader.dog.stop()
        gw.close()


def _run(rig, max_tokens, then):
    """Two jobs; once both produced a token, `then()` runs (on the event loop); every
    job's outputs until its last one."""
    async def main():
        loop = asyncio.get_running_loop()
        jobs = [GenerationJob(loop, [1, 2, 3], SamplingParams(max_tokens=max_tokens,
                                                              temperature=0.0))
                for _ in range(2)]
        for j in jobs:
            rig.gateway.submit(j)
        got = [[] for _ in jobs]
        for i, j in enumerate(jobs):
            got[i] += await asyncio.wait_for(j.get_batch(), 10)
        then()

        async def rest(i, j):
            while not got[i][-1].finished:
                got[i] += await j.get_batch()
        await asyncio.wait_for(asyncio.gather(*(rest(i, j) for i, j in enumerate(jobs))), 10)
        return got
    return asyncio.run(main())


def _wait_exit(rig):
    for _ in range(100):
        if rig.exits:
            break
        time.sleep(0.02)
    return rig.exits


def _assert_rank_lost(outs):
    for got in outs:
        last = got[-1]
        assert last.finish_reason == "error" and isinstance(last.error, tp.RankLost)
        assert last.error.status == 503
        assert "lost a tensor-parallel rank" in last.error.message


def test_stop_signal_then_failing_step_is_a_lost_rank(rig):
    """SIGTERM, then a step whose forward fails with an error that names no collective
    while the heartbeat still goes through: the signal says a rank exited (mlx.launch
    stops the others), so the requests get the 503, not a generic error or a cancel."""
    def then():
        rig.leader.on_shutdown_signal()
        rig.engine.fault = RuntimeError("the step failed")
    outs = _run(rig, 10_000, then)
    _assert_rank_lost(outs)
    assert "a step failed after the stop signal" in outs[0][-1].error.message
    assert _wait_exit(rig) == [tp.EXIT_RANK_LOST]


def test_stop_signal_then_hung_step_is_a_lost_rank(rig):
    """SIGTERM, then a step that blocks: past the shutdown grace (not --tp-timeout) the
    requests get the 503."""
    def then():
        rig.leader.on_shutdown_signal()
        rig.engine.hang.set()
    t0 = time.monotonic()
    outs = _run(rig, 10_000, then)
    assert time.monotonic() - t0 < 5          # the grace (0.5 s here), not the 30 s timeout
    _assert_rank_lost(outs)
    assert "no answer within 0.5 s (step)" in outs[0][-1].error.message
    assert _wait_exit(rig) == [tp.EXIT_RANK_LOST]


def test_stop_signal_with_healthy_steps_lets_requests_finish(rig):
    outs = _run(rig, 30, rig.leader.on_shutdown_signal)
    for got in outs:
        assert got[-1].finish_reason == "length" and got[-1].generation_tokens == 30
        assert sum(len(o.token_ids) for o in got) == 30
    assert not rig.leader.dead.is_set() and rig.exits == []
    rig.gateway.call_sync(rig.leader.send_stop)
    assert rig.sent[-1] == "stop"


PARTIAL_SUM = "broadcast reached 1 of 2 ranks (a rank was lost)"


@pytest.mark.parametrize("error", [RuntimeError(PEER_GONE), RuntimeError(PARTIAL_SUM)],
                         ids=["ring", "partial-sum"])
def test_collective_error_in_a_step_is_a_lost_rank(rig, error):
    """No signal, the heartbeat goes through, but the forward's error came from a
    collective: 503 and exit 3, not a server_error."""
    def then():
        rig.engine.fault = error
    outs = _run(rig, 10_000, then)
    _assert_rank_lost(outs)
    assert str(error) in outs[0][-1].error.message
    assert _wait_exit(rig) == [tp.EXIT_RANK_LOST]


def test_other_step_error_without_a_signal_stays_a_server_error(rig):
    """A fault that names no collective, with every rank answering the heartbeat and no
    stop signal, is the request's failure (500), and the server goes on."""
    err = ValueError("a bug in the sampler")

    def then():
        rig.engine.fault = err
    outs = _run(rig, 10_000, then)
    for got in outs:
        assert got[-1].finish_reason == "error" and got[-1].error is err
    assert "ping" in rig.sent and not rig.leader.dead.is_set() and rig.exits == []


def test_failed_heartbeat_after_a_step_error_is_a_lost_rank(rig, monkeypatch):
    import engine.distributed.sharding

    def broadcast(obj=None, group=None):
        if obj["kind"] == "ping":
            raise RuntimeError("recv: connection reset")
        return obj

    def then():
        monkeypatch.setattr(engine.distributed.sharding, "broadcast_json", broadcast)
        rig.engine.fault = ValueError("nan logits")
    outs = _run(rig, 10_000, then)
    _assert_rank_lost(outs)
    assert "recv: connection reset" in outs[0][-1].error.message
    assert _wait_exit(rig) == [tp.EXIT_RANK_LOST]


def test_a_step_that_ends_a_request_is_confirmed_by_every_rank(rig, monkeypatch):
    """A ring that lost a peer may hand back partial sums instead of an error: the wrong
    logits can end a request (a stop token). A step that ends a request is handed over
    only once a heartbeat reached every rank; here it does not: 503, not a finished 200."""
    import engine.distributed.sharding

    def broadcast(obj=None, group=None):
        rig.sent.append(obj["kind"])
        if obj["kind"] == "ping":
            raise RuntimeError(PARTIAL_SUM)
        return obj
    monkeypatch.setattr(engine.distributed.sharding, "broadcast_json", broadcast)
    outs = _run(rig, 3, lambda: None)
    _assert_rank_lost(outs)
    assert rig.sent.count("ping") == 1 and _wait_exit(rig) == [tp.EXIT_RANK_LOST]


def test_healthy_step_that_ends_a_request_sends_one_heartbeat(rig):
    outs = _run(rig, 3, lambda: None)
    assert [got[-1].finish_reason for got in outs] == ["length", "length"]
    assert rig.sent.count("ping") >= 1 and rig.sent.count("step") >= 3
    assert not rig.leader.dead.is_set()


def test_signal_under_lead_waits_for_the_503s_and_a_loss_exits_3(rig):
    """Through `tp.lead`'s hooks on the uvicorn server: a stop signal raises a shutdown
    timeout shorter than the grace (the 503s go out before uvicorn cancels the requests),
    and a graceful stop that ends after a loss exits with status 3, not the signal's."""
    import signal
    from types import SimpleNamespace

    class Server:
        def __init__(self):
            self.config = SimpleNamespace(timeout_graceful_shutdown=0.0)
            self.signals, self.should_exit = [], False

        def handle_exit(self, sig, frame):
            self.signals.append(sig)

        async def shutdown(self, sockets=None):
            return None

    class App:
        def add_middleware(self, *a, **kw):
            return None

    class State:
        pass
    state = State()
    state.engine, state.gateway, state.adapters = rig.engine, rig.gateway, None
    server = Server()
    leader = tp.lead(state, 30.0, App(), server)
    exits = []
    leader.grace, leader.exit = (30.0, 30.0), exits.append
    try:
        server.handle_exit(signal.SIGTERM, None)
        assert server.signals == [signal.SIGTERM] and leader.stopping
        assert server.config.timeout_graceful_shutdown >= tp.SHUTDOWN_GRACE_S + 1
        leader.fail("test")
        asyncio.run(server.shutdown())
        assert exits == [tp.EXIT_RANK_LOST]
    finally:
        leader.dog.stop()
