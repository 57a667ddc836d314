"""The worker thread: the one owner of the `engine.Engine` (MLX sees one thread only).

The event loop hands it messages on one FIFO queue: a generation job
(`submit`), a call to run on the worker (`call`: loading, mounting or
unmounting an adapter; `between_steps`: an embeddings forward, run at once
between two engine steps), or the stop signal. The worker submits jobs to the
Engine at once and keeps stepping it while any request is unfinished; each
step's `RequestOutput`s go back to their jobs through a thread-safe hand-off.
A call waits until every job submitted before it has finished (an unmount
never removes an adapter under a running request), and everything after it
waits behind it, so arrival order holds; `between_steps` runs at once.

`job.cancel()` (the HTTP client went away) aborts the request at the next
step; a job cancelled while still queued never starts.

Counters (/stats `queue`, /metrics `engine_generations_*`): each job is counted
once, by its last output, in `_end`, before that output is handed over:
`cancelled` when the Engine aborted it before it finished (its client left, it was
cancelled while queued, its request was answered with an error after queueing, the
server stopped); `completed` when it ran to a stop or its length; `failed` for a
server fault. A job cancelled after its last output (the cleanup of a finished
stream) is not in `_jobs` any more: nothing happens and nothing is counted. A
request refused before its first token (a client error) is answered 4xx and
counted in none of them.

Errors: one raised before the request produced a token (prompt build,
admission, an adapter unmounted meanwhile) is the client's; one raised after
is a server fault (`client_error(out)` tells them apart).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

from engine import RequestOutput, client_error

from .errors import APIError
from .memory import Trimmer

# When the HTTP request being handled arrived (set by the outermost middleware, read by the
# Job the request makes): /stats `last_generation.prepare_s`, the time a request spends
# before the engine's queue (reading and checking the body, the chat template, tokenizing).
RECEIVED_AT: "contextvars.ContextVar[Optional[float]]" = contextvars.ContextVar(
    "received_at", default=None)

log = logging.getLogger("engine-serve")


class GenerationJob:
    """One generation: its request and the channel its outputs come back on.

    The worker appends outputs to a locked deque and wakes the event loop only
    when the consumer is actually waiting, so a consumer that is busy (or
    coalescing writes) costs the worker no cross-thread wake-ups."""

    _ids = itertools.count(1)

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt, params=None,
                 adapters: tuple = ()):
        self.id = next(self._ids)
        self.loop = loop
        # the thread the job was made on (the event loop's): its CPU clock, for /stats
        self.loop_cpu_clock = _thread_cpu_clock(threading.get_ident())
        self.prompt = prompt
        self.params = params               # engine.SamplingParams
        self.adapters = tuple(adapters)
        self.vision = None                 # engine.VisionInput: the prompt's images
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()
        self.received_at = RECEIVED_AT.get()
        self.started_at: Optional[float] = None
        self.finished = False
        self.delivered = False             # the worker has handed over an output
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._waiter: Optional[asyncio.Future] = None
        self.interval = 0.0            # seconds between deliveries (stream coalescing)
        self._last = float("-inf")     # monotonic time of the last delivery
        self.clock = _Clock(self)

    # worker side
    def put(self, out: RequestOutput) -> None:
        """Queue an output; wake the consumer only if it waits and `interval` has passed
        since the last delivery (or the output is the last one). Waking from here, just
        before the worker goes back into MLX (which releases the GIL), lets the event
        loop write while the next token computes instead of preempting the worker's
        Python at a timer's whim (measured: a 25 ms timer cost ~4% decode)."""
        w = None
        with self._lock:
            self._items.append(out)
            if self._waiter is not None and (
                    out.finished or time.monotonic() - self._last >= self.interval):
                w, self._waiter = self._waiter, None
        if w is not None:
            self.loop.call_soon_threadsafe(_wake, w)

    # asyncio side
    def cancel(self) -> None:
        """Abort at the next step (nothing to do once the job has finished)."""
        if not self.finished:
            self.cancelled.set()

    def _take(self) -> list:
        items = list(self._items)
        self._items.clear()
        self._last = time.monotonic()
        return items

    async def get_batch(self) -> list:
        """Everything available, at most once per `interval` (stream coalescing; the
        first output and the last one are never held back)."""
        with self._lock:
            if self._items and (self.interval <= 0 or self._items[-1].finished
                                or time.monotonic() - self._last >= self.interval):
                return self._take()
            self._waiter = w = self.loop.create_future()
        await w
        with self._lock:
            return self._take()


class _Clock:
    """When the engine handed over text (before any HTTP work): the engine-side clock
    of one generation, and the CPU time the event loop's thread used meanwhile (all
    the HTTP work; an upper bound on what it can take from the worker through the
    GIL), for /stats `last_generation`."""

    __slots__ = ("job", "first", "last", "cpu_first", "cpu_last", "n", "phases", "cached")

    def __init__(self, job):
        self.job = job
        self.first = self.last = self.cpu_first = self.cpu_last = None
        self.n = self.cached = 0
        self.phases: dict = {}

    def tick(self, out: RequestOutput) -> None:
        self.n, self.cached = out.generation_tokens, out.cached_tokens
        if out.timings:
            self.phases = out.timings
        if out.text:
            self.last = time.perf_counter()
            self.cpu_last = _cpu_s(self.job.loop_cpu_clock)
            if self.first is None:
                self.first, self.cpu_first = self.last, self.cpu_last

    def summary(self) -> dict:
        span = None if self.first is None else self.last - self.first
        return {"job": self.job.id, "generation_tokens": self.n,
                "first_text_s": (None if self.first is None or self.job.started_at is None
                                 else self.first - self.job.started_at),
                "prepare_s": (None if self.job.received_at is None
                              else self.job.queued_at - self.job.received_at),
                "queue_s": (None if self.job.started_at is None
                            else self.job.started_at - self.job.queued_at),
                **{k: self.phases.get(k) for k in ("waiting_s", "lookup_s", "prefill_s")},
                "cached_tokens": self.cached,
                "decode_s": span, "decode_tps": (self.n - 1) / span if span else None,
                "event_loop_cpu_s": (self.cpu_last - self.cpu_first
                                     if self.cpu_first is not None and self.cpu_last is not None
                                     else None)}


def _thread_cpu_clock(ident: int) -> Optional[int]:
    try:
        return time.pthread_getcpuclockid(ident)
    except (AttributeError, OSError):     # not on this platform
        return None


def _cpu_s(clock: Optional[int]) -> Optional[float]:
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:
        return None


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Gateway:
    """The worker thread and its FIFO inbox; `engine` is set once the model is loaded."""

    def __init__(self, name: str = "engine-gateway"):
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.engine = None                        # engine.Engine (set on the worker)
        self._jobs: dict = {}                     # request id -> running job
        self._deferred: deque = deque()           # items waiting for the engine to drain
        self._trimmer = Trimmer()                 # (freed heap pages back to the OS)
        self._stopped = False
        # set by `shed` (SIGTERM): jobs that have produced nothing yet end with this error
        self.shedding: Optional[BaseException] = None
        self._shed_done = False
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.last_generation: Optional[dict] = None
        # while idle, `on_tick()` runs on the worker every `tick_s` seconds (the tensor-parallel
        # heartbeat to the other ranks)
        self.tick_s: Optional[float] = None
        self.on_tick: Optional[Callable] = None
        self._thread.start()

    # --- submitting (any thread) -------------------------------------------------

    def call(self, fn: Callable, *args, **kwargs) -> Future:
        """Run `fn` on the worker (after everything queued before it has finished)."""
        fut: Future = Future()
        self._q.put(("call", fn, args, kwargs, fut))
        return fut

    def call_sync(self, fn: Callable, *args, **kwargs):
        return self.call(fn, *args, **kwargs).result()

    async def call_async(self, fn: Callable, *args, **kwargs):
        return await asyncio.wrap_future(self.call(fn, *args, **kwargs))

    async def between_steps(self, fn: Callable, *args, **kwargs):
        """Run `fn` on the worker between two engine steps, without waiting for the running
        requests to finish (a use of the model that leaves their outputs as they are: an
        embeddings forward, an adapter mount on the L1 runners)."""
        fut: Future = Future()
        self._q.put(("now", fn, args, kwargs, fut))
        return await asyncio.wrap_future(fut)

    def submit(self, job: GenerationJob) -> GenerationJob:
        self._q.put(("gen", job))
        return job

    @property
    def queued(self) -> int:
        """Jobs not started yet (in the inbox, held behind a call, or waiting in the engine)."""
        eng = self.engine
        waiting = eng.stats()["waiting"] if eng is not None else 0
        return self._q.qsize() + len(self._deferred) + waiting

    def stats(self) -> dict:
        eng = self.engine
        active = 0
        if eng is not None:
            st = eng.stats()
            active = st["active_rows"] + int(st["solo_active"])
        return {"queued": self.queued, "active": active, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed,
                "last_generation": self.last_generation}

    def abandon(self, error: BaseException) -> None:
        """End every job, running or queued, with `error` (any thread; for an engine
        that cannot go on, e.g. a lost tensor-parallel rank, whose worker may be stuck)."""
        jobs = list(self._jobs.values()) + [i[1] for i in list(self._deferred) if i[0] == "gen"]
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item[0] == "gen":
                jobs.append(item[1])
            elif item[0] in ("call", "now") and item[4].set_running_or_notify_cancel():
                item[4].set_exception(error)
            elif item[0] == "wake":
                continue
            else:
                self._q.put(item)     # the stop signal stays
                break
        for job in jobs:
            if not job.finished:
                job.finished = True
                job.put(RequestOutput("", [], finish_reason="error", request_id=str(job.id),
                                      error=error, started=False))

    def shed(self, error: BaseException) -> None:
        """Shutting down (any thread): every job that has produced nothing yet -- queued in
        the inbox, held behind a call, waiting in the engine, or arriving from now on -- ends
        with `error` (the server answers it 503); running generations go on until
        `abandon` or their end."""
        self.shedding = error
        self._q.put(("wake",))

    def close(self, timeout: float = 5.0) -> None:
        self._q.put(("stop",))
        self._thread.join(timeout)
        time.sleep(0.05)   # let MLX finish tearing down the thread's stream (see cli.main)

    # --- the worker ------------------------------------------------------------------

    def _busy(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished()

    def _loop(self) -> None:
        while not self._stopped:
            self._intake()
            if self._stopped:
                break
            if self.shedding is not None and not self._shed_done:
                self._shed_waiting()
            for rid, job in list(self._jobs.items()):
                if job.cancelled.is_set():
                    self.engine.abort(rid)
            if self._busy():
                try:      # (the engine ends failing requests itself; this is a last resort)
                    outs = self.engine.step()
                except Exception as e:
                    outs = self._fail_all(e)
                self._deliver(outs)
                if not self._busy() and self._q.empty():   # idle now, nothing waiting:
                    self.engine.idle()  # (CUDA: the next turn's attention shape, Engine.idle)
            self._trimmer.maybe()     # freed heap pages back to the OS (server.memory)
        for rid in list(self._jobs):          # stopping: end whatever still runs
            self.engine.abort(rid)
        if self.engine is not None and self.engine.has_unfinished():
            self._deliver(self.engine.step())

    def _intake(self) -> None:
        """Take the inbox's items: wait for one when there is nothing to step."""
        block = not self._busy() and not self._deferred
        while not self._stopped:
            if self._deferred and not self._busy():
                self._handle(self._deferred.popleft())
                continue
            try:
                item = self._q.get(block=block, timeout=self.tick_s if block else None)
            except queue.Empty:
                if block and self.on_tick is not None:
                    self.on_tick()
                return
            if item[0] == "wake":
                return                           # (shed: the loop applies it now)
            if item[0] == "gen" and self.shedding is not None:
                self._start(item[1])             # ends it at once (503)
                continue
            if item[0] == "now":
                self._handle(item)               # between steps, nothing drained
            elif self._deferred or (item[0] != "gen" and self._busy()):
                self._deferred.append(item)      # behind the running requests
            else:
                self._handle(item)
            block = not self._busy() and not self._deferred

    def _shed_waiting(self) -> None:
        """End (503) the jobs in the engine that have not produced an output yet."""
        self._shed_done = True
        held = [i for i in self._deferred if i[0] == "gen"]
        self._deferred = deque(i for i in self._deferred if i[0] != "gen")
        for item in held:
            self._start(item[1])
        for rid, job in list(self._jobs.items()):
            if job.clock.n == 0 and not job.delivered:
                self.engine.abort(rid)
                del self._jobs[rid]
                self._end(job, RequestOutput("", [], finish_reason="error", request_id=rid,
                                             error=self.shedding, started=False))

    def _handle(self, item) -> None:
        kind = item[0]
        if kind == "stop":
            self._stopped = True
        elif kind in ("call", "now"):
            _, fn, args, kwargs, fut = item
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)
        else:
            self._start(item[1])

    def _start(self, job: GenerationJob) -> None:
        rid = str(job.id)
        if self.shedding is not None:
            self._end(job, RequestOutput("", [], finish_reason="error", request_id=rid,
                                         error=self.shedding, started=False))
            return
        if job.cancelled.is_set():
            self._end(job, RequestOutput("", [], finish_reason="cancelled", request_id=rid,
                                         started=False))
            return
        job.started_at = time.perf_counter()
        try:
            self.engine.submit(job.prompt, job.params, request_id=rid, adapter=job.adapters,
                               **({"vision": job.vision} if job.vision is not None else {}))
        except Exception as e:
            self._end(job, RequestOutput("", [], finish_reason="error", request_id=rid, error=e,
                                         started=False))
            return
        self._jobs[rid] = job

    def _fail_all(self, e: BaseException) -> list:
        outs = []
        for rid in list(self._jobs):
            self.engine.abort(rid)
            outs.append(RequestOutput("", [], finish_reason="error", request_id=rid, error=e))
        self.engine.step()
        return outs

    def _deliver(self, outs) -> None:
        for out in outs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            job.clock.tick(out)
            job.delivered = True
            if not out.finished:
                job.put(out)
                continue
            del self._jobs[out.request_id]
            self._end(job, out)

    def _end(self, job: GenerationJob, out: RequestOutput) -> None:
        """Hand a job its last output and count it (the one place the counters move)."""
        if job.finished:                  # (never twice: a job has one last output)
            return
        job.finished = True
        if out.finish_reason == "cancelled":
            self.cancelled += 1
        elif out.finish_reason == "error":
            if client_error(out):
                pass
            elif isinstance(out.error, APIError):    # (an answer given on purpose: a 503 shed)
                self.failed += 1
                log.warning("generation %s ended: %s %s", job.id, out.error.status,
                            out.error.message)
            else:
                self.failed += 1
                log.error("generation %s failed: %s: %s", job.id, type(out.error).__name__,
                          out.error,
                          exc_info=(type(out.error), out.error, out.error.__traceback__))
        else:
            self.completed += 1
        if out.finish_reason != "error" and job.started_at is not None:
            self.last_generation = job.clock.summary()
        job.put(out)
