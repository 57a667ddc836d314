"""The generation gateway: the single queue every protocol funnels into.

One worker thread owns the model. Every piece of work that touches MLX -
loading, a generation, mounting or unmounting an adapter - is a job on one
FIFO queue, run to completion one at a time in arrival order, so an adapter
mount never races a forward pass and MLX only ever sees one thread.

A generation job streams its `Segment`s back to the asyncio side through a
thread-safe hand-off. `job.cancel()` (called when the HTTP client goes away)
makes the engine stop at the next token (`should_stop`), which ends the job
and frees the queue; a job cancelled while still queued never starts.

Errors: an exception raised before the first segment (prompt build,
admission, bad sampling values, unknown adapter) is the client's and comes
back as `("error", exc, True)`; one raised after generation started is a
server fault, `("error", exc, False)`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

log = logging.getLogger("engine-serve")

CLIENT_ERRORS: tuple = (ValueError, TypeError, KeyError)


class GenerationJob:
    """One generation: its parameters and the channel its segments come back on.

    The worker appends items to a locked deque and wakes the event loop only
    when the consumer is actually waiting, so a consumer that is busy (or
    coalescing writes) costs the worker no cross-thread wake-ups."""

    _ids = itertools.count(1)

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt, options: dict,
                 adapters: tuple = ()):
        self.id = next(self._ids)
        self.loop = loop
        # the thread the job was made on (the event loop's): its CPU clock, for /stats
        self.loop_cpu_clock = _thread_cpu_clock(threading.get_ident())
        self.prompt = prompt
        self.options = options
        self.adapters = tuple(adapters)
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()
        self.started_at: Optional[float] = None
        self.finished = False
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._waiter: Optional[asyncio.Future] = None
        self.interval = 0.0            # seconds between deliveries (stream coalescing)
        self._last = float("-inf")     # monotonic time of the last delivery

    # worker side
    def put(self, item) -> None:
        """Queue an item; wake the consumer only if it waits and `interval` has passed
        since the last delivery (or the item is the last segment / end / error). Waking
        from here, just before the worker goes back into MLX (which releases the GIL),
        lets the event loop write while the next token computes instead of preempting
        the worker's Python at a timer's whim (measured: a 25 ms timer cost ~4% decode)."""
        w = None
        with self._lock:
            self._items.append(item)
            if self._waiter is not None and (
                    _final(item) or time.monotonic() - self._last >= self.interval):
                w, self._waiter = self._waiter, None
        if w is not None:
            self.loop.call_soon_threadsafe(_wake, w)

    # asyncio side
    def cancel(self) -> None:
        self.cancelled.set()

    def _take(self) -> list:
        items = list(self._items)
        self._items.clear()
        self._last = time.monotonic()
        return items

    def drain(self) -> list:
        """Everything available now (no waiting)."""
        with self._lock:
            return self._take()

    async def get_batch(self) -> list:
        """Everything available, at most once per `interval` (stream coalescing; the
        first item, the last segment, the end and errors are never held back)."""
        with self._lock:
            if self._items and (self.interval <= 0 or _final(self._items[-1])
                                or time.monotonic() - self._last >= self.interval):
                return self._take()
            self._waiter = w = self.loop.create_future()
        await w
        with self._lock:
            return self._take()

    async def get(self):
        """One item (tests)."""
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                self._waiter = w = self.loop.create_future()
            await w


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


def _final(item) -> bool:
    return item[0] != "seg" or getattr(item[1], "finish_reason", None) is not None


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Gateway:
    """A FIFO of jobs run one at a time on one worker thread."""

    def __init__(self, name: str = "engine-gateway"):
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._stopping = False
        self.runner: Optional[Callable] = None    # runner(job) -> iterator of segments
        self.active: Optional[GenerationJob] = None
        self.batch_lane = None                    # server.batch_lane.BatchLane (--batch N)
        self._deferred: deque = deque()           # items the batch lane took off the queue
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.last_generation: Optional[dict] = None
        self._thread.start()

    # --- submitting -------------------------------------------------------

    def call(self, fn: Callable, *args, **kwargs) -> Future:
        """Run `fn` on the worker (after everything queued before it)."""
        fut: Future = Future()
        self._q.put(("call", fn, args, kwargs, fut))
        return fut

    def call_sync(self, fn: Callable, *args, **kwargs):
        return self.call(fn, *args, **kwargs).result()

    async def call_async(self, fn: Callable, *args, **kwargs):
        return await asyncio.wrap_future(self.call(fn, *args, **kwargs))

    def submit(self, job: GenerationJob) -> GenerationJob:
        self._q.put(("gen", job))
        return job

    @property
    def queued(self) -> int:
        return self._q.qsize() + len(self._deferred)

    def stats(self) -> dict:
        return {"queued": self.queued, "active": 1 if self.active is not None else 0,
                "completed": self.completed, "cancelled": self.cancelled, "failed": self.failed,
                "last_generation": self.last_generation}

    def close(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._q.put(("stop",))
        self._thread.join(timeout)
        time.sleep(0.05)   # let MLX finish tearing down the thread's stream (see cli.main)

    # --- the worker -------------------------------------------------------

    def _loop(self) -> None:
        while True:
            item = self._deferred.popleft() if self._deferred else self._q.get()
            kind = item[0]
            if kind == "stop":
                return
            if kind == "call":
                _, fn, args, kwargs, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)
                continue
            lane = self.batch_lane
            if lane is not None and not item[1].cancelled.is_set() and lane.accepts(item[1]):
                lane.run(item[1], self)
                continue
            self._generate(item[1])

    def _generate(self, job: GenerationJob) -> None:
        if job.cancelled.is_set():
            self.cancelled += 1
            job.finished = True
            job.put(("end", "cancelled"))
            return
        self.active = job
        job.started_at = time.perf_counter()
        started = False
        first = last = None
        cpu_first = cpu_last = None
        n = 0
        try:
            for seg in self.runner(job):
                started = True
                if getattr(seg, "text", None):      # (runners in tests yield plain values)
                    # when the engine handed over text (before any HTTP work): the
                    # engine-side clock of this generation, and the CPU time the event
                    # loop's thread used meanwhile (all the HTTP work; an upper bound on
                    # what it can take from this thread through the GIL), for /stats
                    last = time.perf_counter()
                    cpu_last = _cpu_s(job.loop_cpu_clock)
                    if first is None:
                        first, cpu_first = last, cpu_last
                n = getattr(seg, "generation_tokens", n)
                job.put(("seg", seg))
            job.put(("end", None))
            span = None if first is None else last - first
            self.last_generation = {
                "job": job.id, "generation_tokens": n,
                "first_text_s": None if first is None else first - job.started_at,
                "decode_s": span,
                "decode_tps": (n - 1) / span if span else None,
                "event_loop_cpu_s": (cpu_last - cpu_first if cpu_first is not None
                                     and cpu_last is not None else None)}
            if job.cancelled.is_set():
                self.cancelled += 1
            else:
                self.completed += 1
        except BaseException as e:
            client = not started and isinstance(e, CLIENT_ERRORS)
            if not client:
                self.failed += 1
                log.error("generation %d failed:\n%s", job.id, traceback.format_exc())
            job.put(("error", e, client))
        finally:
            job.finished = True
            self.active = None
