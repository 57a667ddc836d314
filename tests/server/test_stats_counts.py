"""/stats `queue` counts each generation once and exactly: `cancelled` only when the
client left (or the job was aborted) before it finished, `completed` when it ran to
its end; /metrics reports the same counters; `batch.peak_rows` / `rows_now` count rows
decoding, never more than --batch.

The server test runs streams on all four protocols at once (`--batch 4`, and one at a
time), some dropped by their clients at known chunks (EOS banned, thousands of tokens
asked: they are certainly still running when their client leaves), some run to their
length, and non-streamed requests whose clients time out (running, or still queued).
The gateway tests drive its counting paths one by one on a scripted engine: a finished
job "cancelled" by cleanup code, a job cancelled while queued, a fault at submit."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from engine.step.request import RequestOutput
from server.gateway import Gateway, GenerationJob

from srv_helpers import start_server, stop_server

EOS = {"1009": -100, "1016": -100, "1017": -100}     # the llama fixture's end tokens
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
LONG = 4000          # tokens a dropped request asks for (it is cancelled long before)


def _body(path: str, text: str, n: int, stream: bool) -> dict:
    if path == "/v1/completions":
        body = {"prompt": text, "max_tokens": n}
    elif path == "/v1/responses":
        body = {"input": text, "max_output_tokens": n, "store": False}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": n}
    return {**body, "stream": stream, "logit_bias": EOS}


def _stream(url, path, text, n, drop_at, got, i):
    """Read a stream; leave after `drop_at` data chunks (None: read to the end)."""
    chunks = 0
    with httpx.stream("POST", url + path, json=_body(path, text, n, True), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
                if drop_at is not None and chunks >= drop_at:
                    got[i] = "left"
                    return
    got[i] = "read to the end"


def _plain_timeout(url, path, got, i):
    try:
        httpx.post(url + path, json=_body(path, f"plain {i}", LONG, False), timeout=2.0)
        got[i] = "answered"
    except httpx.TimeoutException:
        got[i] = "left"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("batch", [1, 4], ids=["serial", "batch4"])
def test_stats_count_real_disconnects_exactly(llama_dir, batch):
    s = start_server(llama_dir, batch=batch, max_tokens=16, temperature=0.0)
    try:
        jobs = []      # (target, args): 4 streams dropped at known chunks, 4 read to the end
        for k, (path, drop_at) in enumerate(zip(PATHS, (1, 2, 3, 5))):
            jobs.append((_stream, (s.url, path, f"drop {k}", LONG, drop_at)))
            jobs.append((_stream, (s.url, PATHS[-1 - k], f"keep {k}", 6, None)))
        jobs += [(_plain_timeout, (s.url, PATHS[0])), (_plain_timeout, (s.url, PATHS[2]))]
        got = [None] * len(jobs)
        threads = [threading.Thread(target=fn, args=(*args, got, i))
                   for i, (fn, args) in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        left = got.count("left")
        assert left == 6 and got.count("read to the end") == 4, got
        t0 = time.monotonic()
        while True:          # the last aborts land within a step of the clients leaving
            st = httpx.get(s.url + "/stats").json()
            q, b = st["queue"], st["batch"]
            if (q["active"] == 0 and q["queued"] == 0 and b["rows_now"] == 0) \
                    or time.monotonic() - t0 > 30:
                break
            time.sleep(0.05)
        assert (q["cancelled"], q["completed"], q["failed"]) == (left, 4, 0), q
        assert q["active"] == 0 and q["queued"] == 0
        assert 1 <= b["peak_rows"] <= batch and b["rows_now"] == 0 and b["active_rows"] == 0, b
        m = httpx.get(s.url + "/metrics").text
        assert _metric(m, "engine_generations_cancelled_total") == q["cancelled"]
        assert _metric(m, "engine_generations_completed_total") == q["completed"]
        assert _metric(m, "engine_generations_failed_total") == 0
        assert _metric(m, "engine_batch_rows_peak") == b["peak_rows"]
        assert _metric(m, "engine_batch_rows_decoding") == 0
    finally:
        stop_server(s)


# --- the gateway's counting paths, on a scripted engine ---------------------------


class Scripted:
    """Each request: `steps` outputs, the last with finish_reason "length"; one runs at a
    time, the rest wait (and can be aborted there). `submit_error` is raised at submit."""

    def __init__(self, steps: int = 2, submit_error=None):
        self.steps, self.submit_error = steps, submit_error
        self.waiting, self.running, self.done_now = [], None, []

    def submit(self, prompt, params=None, *, request_id=None, adapter=()):
        if self.submit_error is not None:
            raise self.submit_error
        self.waiting.append([request_id, 0])

    def has_unfinished(self):
        return bool(self.waiting or self.running or self.done_now)

    def idle(self):
        self.idles = getattr(self, "idles", 0) + 1
        return False

    def abort(self, rid):
        if self.running is not None and self.running[0] == rid:
            self.running = None
        else:
            found = [r for r in self.waiting if r[0] == rid]
            if not found:
                return False
            self.waiting.remove(found[0])
        self.done_now.append(RequestOutput("", [], finish_reason="cancelled", request_id=rid))
        return True

    def stats(self):
        return {"waiting": len(self.waiting), "active_rows": 0,
                "solo_active": self.running is not None}

    def step(self):
        outs, self.done_now = self.done_now, []
        if self.running is None and self.waiting:
            self.running = self.waiting.pop(0)
        if self.running is not None:
            time.sleep(0.005)
            self.running[1] += 1
            end = self.running[1] >= self.steps
            outs.append(RequestOutput("x", [1], finish_reason="length" if end else None,
                                      request_id=self.running[0]))
            if end:
                self.running = None
        return outs


async def _last(job) -> RequestOutput:
    while True:
        items = await job.get_batch()
        if items and items[-1].finished:
            return items[-1]


def _counts(gw) -> tuple:
    st = gw.stats()
    return st["completed"], st["cancelled"], st["failed"]


def test_gateway_counts_each_job_once():
    gw = Gateway()
    gw.engine = Scripted(steps=40)

    async def main():
        loop = asyncio.get_running_loop()
        done = gw.submit(GenerationJob(loop, "done"))
        held = gw.submit(GenerationJob(loop, "held"))      # waits behind `done`
        held.cancel()                # cancelled while queued in the engine: once
        held.cancel()
        assert (await _last(held)).finish_reason == "cancelled"
        assert _counts(gw) == (0, 1, 0)      # counted before its last output was handed over
        assert (await _last(done)).finish_reason == "length"
        assert _counts(gw) == (1, 1, 0)
        done.cancel()                # a finished stream's cleanup: not a cancellation
        done.cancel()
        assert not done.cancelled.is_set()
        early = GenerationJob(loop, "early")
        early.cancel()               # cancelled before the worker took it: once
        gw.submit(early)
        assert (await _last(early)).finish_reason == "cancelled"
        after = gw.submit(GenerationJob(loop, "after"))
        assert (await _last(after)).finish_reason == "length"
    try:
        asyncio.run(main())
        assert _counts(gw) == (2, 2, 0)
    finally:
        gw.close()


@pytest.mark.parametrize("error, failed", [(ValueError("bad prompt"), 0),
                                           (RuntimeError("engine fault"), 1)])
def test_gateway_counts_a_fault_at_submit_as_failed_and_a_client_error_nowhere(error, failed):
    gw = Gateway()
    gw.engine = Scripted(submit_error=error)

    async def main():
        job = gw.submit(GenerationJob(asyncio.get_running_loop(), "p"))
        out = await _last(job)
        assert out.finish_reason == "error" and out.error is error
    try:
        asyncio.run(main())
        assert _counts(gw) == (0, 0, failed)
    finally:
        gw.close()
