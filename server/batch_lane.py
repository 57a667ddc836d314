"""The batch lane (`--batch N`): continuous batching on the gateway's worker thread.

The gateway's worker hands a batchable generation job to `BatchLane.run`,
which keeps an `engine.batch.BatchScheduler` stepping. Between steps it takes
further jobs off the gateway queue without waiting. Batchable jobs join the
batch once the aggregate KV budget allows. Anything else (a serial-lane job,
a call such as an adapter mount, the stop signal) is deferred back to the
gateway in arrival order. From then on later jobs are deferred too, so the
batch drains and FIFO order holds across the two lanes. Everything runs on
the one worker thread, so the two lanes never run a forward pass at the same
time.

A request goes to the serial lane when the batch cannot give it the serial
lane's result:
- per-request adapters (the batch runs the base weights);
- quantized KV (`--kv-quant`), which disables the lane altogether.

An explicit `seed` is carried by its row: the row samples with its own PRNG key,
`mx.random.key(seed)` split once per step, which is the key sequence the serial
lane's `mx.random.seed(seed)` gives its sampler (so equal logits give equal
tokens; tested), and no other row's draws move it.

Repetition, presence and frequency penalties and logit bias are carried per
row; they are L1-tested against mlx-lm's BatchGenerator.

Prompt cache: a row starts from the longest cached prefix (`cached_tokens` >
0) and stores its KV (prompt plus output) when it finishes. Admission is
aggregate: a job joins only while
`weights + rows x kv_bytes(longest prompt+max_tokens) + chunk transients`
fits the budget (batched caches are padded to the longest row). Otherwise it
waits in the lane, and a lone request always runs, since the per-request
check already passed.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import Optional

SERIAL_REASONS = ("adapters",)


class _Ctx:
    __slots__ = ("job", "ids", "reused", "ns", "n", "fed", "pending_ids", "pending_lp",
                 "tic", "prompt_tps", "top", "want_lp", "need")

    def __init__(self, job, ids, reused, ns, need):
        self.job, self.ids, self.reused, self.ns, self.need = job, ids, reused, ns, need
        self.n = 0
        self.fed: list = []
        self.pending_ids: list = []
        self.pending_lp: list = []
        self.tic = time.perf_counter()
        self.prompt_tps = 0.0
        o = job.options
        self.top = o.get("top_logprobs") or 0
        self.want_lp = bool(o.get("logprobs") or self.top)


class BatchLane:
    def __init__(self, state, size: int):
        self.state = state
        self.size = int(size)
        self.batched_jobs = 0
        self.serial_jobs = 0
        self.serial_reasons: dict = {}
        self.active_rows = 0
        self.waiting = 0
        self.steps = 0
        self.peak_rows = 0
        self.max_queue = 8 * self.size     # jobs waiting (gateway queue + lane) before 503
        self.rejected = 0

    # --- the lane picker -------------------------------------------------------
    def reason(self, job) -> Optional[str]:
        """Why `job` must run on the serial lane (None: it can be batched)."""
        if tuple(job.adapters):
            return "adapters"
        return None

    def accepts(self, job) -> bool:
        r = self.reason(job)
        if r is not None:
            self.serial_jobs += 1
            self.serial_reasons[r] = self.serial_reasons.get(r, 0) + 1
        return r is None

    def check_queue(self, gateway) -> None:
        """Refuse a new request (503, Retry-After) when the wait queue is full. Any thread."""
        if gateway.queued + self.waiting >= self.max_queue:
            from .errors import APIError
            self.rejected += 1
            err = APIError(503, f"the server is at capacity ({self.max_queue} requests "
                                "waiting); retry shortly", type="overloaded_error")
            err.headers = {"Retry-After": "1"}
            raise err

    def stats(self) -> dict:
        return {"configured": self.size, "batched": True, "available": True,
                "active_rows": self.active_rows, "queued": self.waiting, "steps": self.steps,
                "peak_rows": self.peak_rows, "max_queue": self.max_queue,
                "rejected": self.rejected,
                "lanes": {"batch": self.batched_jobs, "serial": self.serial_jobs},
                "serial_reasons": dict(self.serial_reasons)}

    # --- aggregate admission ------------------------------------------------------
    def _fits(self, needs: list) -> bool:
        adm = self.state.admission
        longest = max(needs)
        per_row = (adm.transient_bytes(min(longest, adm.prefill_step))
                   - adm.FIXED_SLACK[adm.backend])
        peak = (adm.weights + len(needs) * adm.kv_bytes(longest) + adm.transient_bytes(longest)
                + (min(len(needs), 8) - 1) * per_row)
        return peak <= adm.budget_bytes

    # --- the loop -----------------------------------------------------------------
    def run(self, first, gateway) -> None:
        from engine.batch import BatchRequest, BatchScheduler
        from engine.generation import _token_logprob, sampling_defaults
        from engine.sampling import make_logits_processors, make_sampler

        st = self.state
        st.adapters.activate(())
        ns = st.adapters.namespace(())
        d = sampling_defaults(st.tokenizer)
        sched = BatchScheduler(st.model, tokenizer=st.tokenizer,
                               completion_batch_size=self.size,
                               prefill_batch_size=min(self.size, 8),
                               prefill_step_size=st.config.prefill_step_size)
        rows: dict = {}
        waiting = deque([first])
        deferring = False
        samplers: dict = {}

        def start(job) -> None:
            o = job.options
            ids = list(job.prompt)
            try:
                st.admission.check(len(ids), o["max_tokens"])
                settings = tuple(d[k] if o.get(k2) is None else o[k2] for k, k2 in (
                    ("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                    ("top_k", "top_k")))
                if settings not in samplers:      # one object per setting: batched calls
                    samplers[settings] = make_sampler(temp=settings[0], top_p=settings[1],
                                                      min_p=settings[2], top_k=settings[3])
                procs = make_logits_processors(
                    logit_bias=o.get("logit_bias"),
                    repetition_penalty=o.get("repetition_penalty"),
                    repetition_context_size=o.get("repetition_context_size", 20),
                    presence_penalty=o.get("presence_penalty"),
                    frequency_penalty=o.get("frequency_penalty"))
                stop = o.get("stop") or []
                stop = [stop] if isinstance(stop, str) else list(stop)
            except (ValueError, TypeError, KeyError) as e:
                job.finished = True
                job.put(("error", e, True))
                return
            caches, reused = None, 0
            if st.prompt_cache is not None:
                hit = st.prompt_cache.fetch(ns, ids)
                if hit is not None:
                    caches, reused = hit.caches, hit.reused
            job.started_at = time.perf_counter()
            uid = sched.submit(BatchRequest(
                ids[reused:], max_tokens=o["max_tokens"], sampler=samplers[settings],
                seed=o.get("seed"),
                logits_processors=procs, stop=stop, caches=caches, history=ids[:reused],
                return_cache=st.prompt_cache is not None))
            rows[uid] = _Ctx(job, ids, reused, ns, len(ids) + o["max_tokens"])
            self.batched_jobs += 1

        def segment(c: _Ctx, text: str, reason=None):
            from engine.generation import Segment
            now = time.perf_counter()
            seg = Segment(text=text, token_ids=c.pending_ids, logprobs=c.pending_lp,
                          finish_reason=reason, prompt_tokens=len(c.ids), cached_tokens=c.reused,
                          generation_tokens=c.n, prompt_tps=c.prompt_tps,
                          generation_tps=c.n / (now - c.tic) if now > c.tic else 0.0)
            c.pending_ids, c.pending_lp = [], []
            return seg

        try:
            while True:
                # 1. take new work off the gateway queue (no waiting)
                while True:
                    try:
                        item = gateway._q.get_nowait()
                    except queue.Empty:
                        break
                    if not deferring and item[0] == "gen" and self.reason(item[1]) is None:
                        waiting.append(item[1])
                        continue
                    deferring = True
                    gateway._deferred.append(item)
                # 2. cancellations, then admission under the aggregate budget
                for uid, c in list(rows.items()):
                    if c.job.cancelled.is_set() and sched.cancel(uid):
                        pass
                while waiting:
                    job = waiting[0]
                    if job.cancelled.is_set():
                        waiting.popleft()
                        job.finished = True
                        gateway.cancelled += 1
                        job.put(("end", "cancelled"))
                        continue
                    need = len(job.prompt) + job.options.get("max_tokens", 0)
                    if rows and not self._fits([c.need for c in rows.values()] + [need]):
                        break
                    waiting.popleft()
                    start(job)
                self.active_rows, self.waiting = len(rows), len(waiting)
                self.peak_rows = max(self.peak_rows, len(rows))
                if not sched.has_work():
                    if not waiting:
                        return
                    continue
                # 3. one step
                events = sched.step()
                self.steps += 1
                for ev in events:
                    c = rows.get(ev.uid)
                    if c is None:
                        continue
                    if ev.finish_reason == "cancelled":
                        del rows[ev.uid]
                        c.job.finished = True
                        gateway.cancelled += 1
                        c.job.put(("end", "cancelled"))
                        continue
                    if ev.token is not None:
                        c.fed.append(ev.token)
                        if len(c.fed) == 1:
                            now = time.perf_counter()
                            c.prompt_tps = (len(c.ids) - c.reused) / max(now - c.tic, 1e-9)
                            c.tic = now
                        if not ev.stop_token:
                            c.n += 1
                            c.pending_ids.append(ev.token)
                            if c.want_lp:
                                c.pending_lp.append(_token_logprob(ev.token, ev.logprobs, c.top))
                    if ev.finish_reason is None:
                        if ev.text:
                            c.job.put(("seg", segment(c, ev.text)))
                        continue
                    del rows[ev.uid]
                    c.job.put(("seg", segment(c, ev.text, ev.finish_reason)))
                    c.job.put(("end", None))
                    c.job.finished = True
                    gateway.completed += 1
                    if ev.caches is not None and st.prompt_cache is not None:
                        tokens = c.ids + c.fed
                        st.prompt_cache.store(c.ns, tokens[:ev.caches[0].offset], ev.caches,
                                              copy_caches=False)
        except BaseException as e:     # a server fault: fail every row still in the batch
            for c in rows.values():
                gateway.failed += 1
                c.job.finished = True
                c.job.put(("error", e, False))
            for job in waiting:
                job.finished = True
                job.put(("error", e, False))
            import logging
            import traceback
            logging.getLogger("engine-serve").error("batch lane failed:\n%s",
                                                    traceback.format_exc())
            del e
        finally:
            self.active_rows = self.waiting = 0


def install(state) -> Optional[BatchLane]:
    """Switch `state`'s gateway into batching mode (no-op with quantized KV)."""
    n = int(getattr(state.config, "batch", 1) or 1)
    if n <= 1 or state.kv_options:
        return None
    lane = BatchLane(state, n)
    state.batch_lane = lane
    state.gateway.batch_lane = lane
    return lane
