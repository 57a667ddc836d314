"""The single generation queue: FIFO, one at a time, disconnect frees it."""

import asyncio
import threading
import time
import uuid

import httpx
import pytest

from engine.step.request import RequestOutput
from server.gateway import Gateway, GenerationJob, client_error

from srv_helpers import NO_EOS


class FakeEngine:
    """The Engine's interface, scripted: one request at a time, three outputs each."""

    def __init__(self, log=None, gate=None, fail=None):
        self.log, self.gate, self.fail = log if log is not None else [], gate, fail
        self.queue, self.cur, self.done_now = [], None, []

    def submit(self, prompt, params=None, *, request_id=None, adapter=()):
        if self.fail:
            raise ValueError(self.fail)
        self.queue.append([request_id, prompt, 0])
        return request_id

    def has_unfinished(self):
        return bool(self.queue or self.cur or self.done_now)

    def idle(self):
        self.idles = getattr(self, "idles", 0) + 1
        return False

    def abort(self, rid):
        for r in self.queue:
            if r[0] == rid:
                self.queue.remove(r)
                self.done_now.append(RequestOutput("", [], "cancelled", request_id=rid))
                return True
        return False

    def stats(self):
        return {"waiting": len(self.queue), "active_rows": 0, "solo_active": self.cur is not None}

    def step(self):
        outs, self.done_now = self.done_now, []
        if self.cur is None and self.queue:
            self.cur = self.queue.pop(0)
            self.log.append(("start", self.cur[1]))
        if self.cur is None:
            return outs
        if self.gate is not None:
            self.gate.wait(5)
        time.sleep(0.01)
        rid, prompt, i = self.cur
        self.cur[2] += 1
        fin = "length" if i == 2 else None
        outs.append(RequestOutput(str(i), [i], finish_reason=fin, request_id=rid))
        if fin:
            self.log.append(("end", prompt))
            self.cur = None
        return outs


async def _drain(job):
    items = []
    while not items or not items[-1].finished:
        items.extend(await job.get_batch())
    return items


def test_fifo_one_at_a_time_unit():
    gw = Gateway()
    log = []
    gw.engine = FakeEngine(log)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [gw.submit(GenerationJob(loop, p)) for p in range(5)]
        mount = asyncio.ensure_future(gw.call_async(lambda: log.append(("call", None))))
        out = [[o.token_ids[0] for o in await _drain(j)] for j in jobs]
        await mount
        return out
    out = asyncio.run(main())
    gw.close()
    assert out == [[0, 1, 2]] * 5
    # strictly sequential, in arrival order; the admin call ran after the queued jobs
    assert log == [x for p in range(5) for x in (("start", p), ("end", p))] + [("call", None)]
    assert gw.completed == 5


def test_cancelled_while_queued_never_runs():
    gw = Gateway()
    log = []
    gate = threading.Event()
    gw.engine = FakeEngine(log, gate)

    async def main():
        loop = asyncio.get_running_loop()
        a = gw.submit(GenerationJob(loop, "a"))
        b = gw.submit(GenerationJob(loop, "b"))
        b.cancel()
        gate.set()
        assert [o.finish_reason for o in await _drain(b)] == ["cancelled"]
        await _drain(a)
    asyncio.run(main())
    gw.close()
    assert [p for k, p in log if k == "start"] == ["a"] and gw.cancelled == 1


def test_client_errors_before_start_are_client_errors():
    gw = Gateway()
    gw.engine = FakeEngine(fail="bad temperature")

    async def main():
        job = gw.submit(GenerationJob(asyncio.get_running_loop(), "p"))
        return (await _drain(job))[-1]
    out = asyncio.run(main())
    gw.close()
    assert out.finish_reason == "error" and client_error(out) and "bad temperature" in str(out.error)


def _stats(srv):
    return httpx.get(srv.url + "/stats").json()["queue"]


def _wait_idle(srv, timeout=5.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        q = _stats(srv)
        if q["active"] == 0 and q["queued"] == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"queue still busy: {q}")


def _long_stream_body(n=4000):      # (as long as the fixture's 4,096-token context allows)
    return {"messages": [{"role": "user", "content": f"go {uuid.uuid4().hex[:6]}"}],
            "max_tokens": n, "temperature": 0, "stream": True, "logit_bias": NO_EOS}


def test_stream_disconnect_stops_generation_and_frees_queue(srv):
    _wait_idle(srv)
    before = _stats(srv)
    with httpx.stream("POST", srv.v1 + "/chat/completions", json=_long_stream_body(),
                      timeout=30) as r:
        assert r.status_code == 200
        chunks = 0
        for _ in r.iter_lines():
            chunks += 1
            if chunks > 6:
                break
    # 200k tokens would take minutes; the disconnect must end it at once
    assert _wait_idle(srv) < 3.0
    after = _stats(srv)
    assert after["cancelled"] == before["cancelled"] + 1
    r = httpx.post(srv.v1 + "/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "next"}], "max_tokens": 3})
    assert r.status_code == 200


def test_non_stream_disconnect_stops_generation(srv):
    _wait_idle(srv)
    before = _stats(srv)
    body = _long_stream_body()
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.v1 + "/chat/completions", json=body, timeout=0.5)
    assert _wait_idle(srv) < 3.0
    assert _stats(srv)["cancelled"] == before["cancelled"] + 1


def test_http_requests_are_served_in_arrival_order(srv):
    _wait_idle(srv)
    spans = {}
    clients = {n: httpx.Client(timeout=60) for n in "abc"}   # built before any timing

    def go(name, delay):
        time.sleep(delay)
        t0 = time.monotonic()
        first = None
        body = _long_stream_body(40)
        with clients[name].stream("POST", srv.v1 + "/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and first is None:
                    first = time.monotonic()
        spans[name] = (t0, first, time.monotonic())

    threads = [threading.Thread(target=go, args=(n, i * 0.1)) for i, n in enumerate("abc")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients.values():
        c.close()
    a, b, c = spans["a"], spans["b"], spans["c"]
    assert a[0] < b[0] < c[0]
    # served one at a time, in arrival order: each first byte only after the previous end
    assert a[1] < b[1] < c[1]
    assert b[1] >= a[2] - 0.05 and c[1] >= b[2] - 0.05


@pytest.mark.parametrize("path", ["/messages", "/responses", "/completions"])
def test_disconnect_stops_generation_on_every_protocol(srv, path):
    _wait_idle(srv)
    before = _stats(srv)
    n = 4000
    body = {"/messages": {"messages": [{"role": "user", "content": uniq_go()}],
                          "max_tokens": n},
            "/responses": {"input": uniq_go(), "max_output_tokens": n},
            "/completions": {"prompt": uniq_go(), "max_tokens": n}}[path]
    body.update(temperature=0, stream=True, logit_bias=NO_EOS)
    with httpx.stream("POST", srv.v1 + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break
    assert _wait_idle(srv) < 3.0
    assert _stats(srv)["cancelled"] == before["cancelled"] + 1


def uniq_go():
    return f"go {uuid.uuid4().hex[:6]}"


def test_coalescing_holds_batches_but_never_the_end():
    """With an interval, the consumer gets at most one batch per interval while the
    worker streams; the first item and the last segment / end come through at once."""
    from types import SimpleNamespace as NS

    async def main():
        loop = asyncio.get_running_loop()
        job = GenerationJob(loop, "p")
        job.interval = 0.2
        seg = NS(finished=False)

        def worker():
            for _ in range(40):              # 40 tokens, 10 ms apart
                job.put(seg)
                time.sleep(0.01)
            time.sleep(0.05)
            ended.append(time.monotonic() - t0)
            job.put(NS(finished=True))
        t0 = time.monotonic()
        threading.Thread(target=worker).start()
        got = []
        while True:
            items = await job.get_batch()
            got.append((time.monotonic() - t0, len(items)))
            if items[-1].finished:
                return got
    ended = []
    got = asyncio.run(main())
    times = [t for t, _ in got]
    assert sum(n for _, n in got) == 41
    assert times[0] < 0.1                                  # the first item at once
    assert all(b - a >= 0.19 for a, b in zip(times[:-2], times[1:-1]))
    assert len(got) <= 5                                   # not one batch per token
    # the end is not held back for the interval (0.2 s): it arrives soon after it was put,
    # measured from the worker's own clock so a slow machine's late sleeps do not count
    assert times[-1] - ended[0] < 0.15


def test_the_engine_works_while_idle_not_while_busy():
    """Between requests the worker gives the engine its idle moment (Engine.idle: on CUDA the
    next turn's attention shape); never while a request runs."""
    gw = Gateway()
    eng = FakeEngine()
    gw.engine = eng
    busy = []
    real = eng.idle
    eng.idle = lambda: busy.append(eng.has_unfinished()) or real()

    async def main():
        await _drain(gw.submit(GenerationJob(asyncio.get_running_loop(), "a")))
    asyncio.run(main())
    deadline = time.time() + 5
    while not busy and time.time() < deadline:
        time.sleep(0.01)
    gw.close()
    assert busy and not any(busy)
