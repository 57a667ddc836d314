"""Batched schedules run on both engines: ours (`engine.step.batch.BatchScheduler`) and
mlx-lm 0.32.2's `BatchGenerator`, driven step for step.

A schedule is a list of `Insert(step, prompt, max_tokens, stop_token)`: before
the loop's `step`-th call, the request joins. Both drivers return, per request
(in insertion order), the emitted tokens, the per-step logprobs [V] and the
finish reason; `compare` checks them with `mx.array_equal` (no tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx


@dataclass
class Insert:
    step: int
    prompt: Sequence[int]
    max_tokens: int = 16
    stop_token: Optional[int] = None      # a row-specific stop token (None: no stop token)
    seed: Optional[int] = None
    temp: float = 0.0
    cancel_step: Optional[int] = None     # removed before this loop step (client disconnect)
    processors: Optional[dict] = None     # make_logits_processors(**processors)


@dataclass
class RowResult:
    tokens: list
    logprobs: list
    finish: Optional[str]


_BATCH = dict(completion_batch_size=32, prefill_batch_size=8, prefill_step_size=2048)


def _collect(rows, uid, token, logprobs, finish):
    r = rows[uid]
    r.tokens.append(int(token))
    r.logprobs.append(logprobs)
    if finish is not None:
        r.finish = finish


def run_ours(model, schedule: Sequence[Insert], max_steps: int = 10_000, **batch):
    from engine.step.batch import BatchRequest, BatchScheduler
    from engine.step.sampling import make_logits_processors, make_sampler

    sched = BatchScheduler(model, eos_token_ids=(), **{**_BATCH, **batch})
    rows, order, ids = {}, [], {}
    samplers = {}
    for step in range(max_steps):
        for k, ins in enumerate(schedule):
            if ins.step == step:
                if ins.temp not in samplers:
                    samplers[ins.temp] = make_sampler(temp=ins.temp)
                uid = sched.submit(BatchRequest(
                    list(ins.prompt), max_tokens=ins.max_tokens, sampler=samplers[ins.temp],
                    seed=ins.seed,
                    logits_processors=make_logits_processors(**ins.processors) if ins.processors else (),
                    stop_tokens=() if ins.stop_token is None else (ins.stop_token,)))
                rows[uid] = RowResult([], [], None)
                order.append(uid)
                ids[k] = uid
        for k, ins in enumerate(schedule):
            if ins.cancel_step == step and k in ids:
                sched.cancel(ids[k])
        if step > max(i.step for i in schedule) and not sched.has_work():
            break
        for ev in sched.step():
            if ev.token is not None:
                _collect(rows, ev.uid, ev.token, ev.logprobs, ev.finish_reason)
            else:
                rows[ev.uid].finish = ev.finish_reason
    return [rows[ids[k]] for k in range(len(schedule))]


def run_mlx_lm(model, schedule: Sequence[Insert], max_steps: int = 10_000, **batch):
    from mlx_lm.generate import BatchGenerator, StopSequences
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    gen = BatchGenerator(model, **{**_BATCH, **batch})
    rows, order, ids = {}, [], {}
    samplers = {}
    try:
        for step in range(max_steps):
            for k, ins in enumerate(schedule):
                if ins.step == step:
                    if ins.temp not in samplers:
                        samplers[ins.temp] = make_sampler(temp=ins.temp)
                    stop = StopSequences([[ins.stop_token]] if ins.stop_token is not None else None)
                    (uid,) = gen.insert([list(ins.prompt)], max_tokens=[ins.max_tokens],
                                        samplers=[samplers[ins.temp]], stop_sequences=[stop],
                                        logits_processors=[make_logits_processors(**ins.processors)
                                                           if ins.processors else []])
                    rows[uid] = RowResult([], [], None)
                    order.append(uid)
                    ids[k] = uid
            for k, ins in enumerate(schedule):
                if ins.cancel_step == step and k in ids:
                    gen.remove([ids[k]])
                    if rows[ids[k]].finish is None:
                        rows[ids[k]].finish = "cancelled"
            busy = (len(gen._unprocessed_sequences) + len(gen._prompt_batch)
                    + len(gen._generation_batch))
            if step > max(i.step for i in schedule) and not busy:
                break
            _, responses = gen.next()
            for r in responses:
                _collect(rows, r.uid, r.token, r.logprobs, r.finish_reason)
    finally:
        gen.close()
    return [rows[ids[k]] for k in range(len(schedule))]


def run_engine(eng, schedule: Sequence[Insert]):
    """The same schedule through an `engine.Engine` (greedy; its outputs carry the
    logprob vectors: `keep_logprob_arrays=True`): each Insert is submitted before the
    `step`-th `eng.step()` and aborted before the `cancel_step`-th. Per Insert, a
    RowResult (finish None: still running when the loop stopped)."""
    from engine import SamplingParams

    rids, rows = {}, {}
    last = max([i.step for i in schedule] + [i.cancel_step or 0 for i in schedule])
    step = 0
    while step <= last or eng.has_unfinished():
        for k, ins in enumerate(schedule):
            if ins.step == step:
                rids[k] = eng.submit(list(ins.prompt), SamplingParams(
                    max_tokens=ins.max_tokens, temperature=ins.temp, seed=ins.seed))
                rows[rids[k]] = RowResult([], [], None)
            if ins.cancel_step == step and k in rids:
                assert eng.abort(rids[k])
        for out in eng.step():
            assert out.error is None, out.error
            r = rows[out.request_id]
            r.tokens += out.token_ids
            r.logprobs += out.logprob_arrays
            if out.finished:
                r.finish = out.finish_reason
        step += 1
    return [rows[rids[k]] for k in range(len(schedule))]


def compare(ours, ref):
    """[(row, problem)] for every difference (empty list: bit-identical)."""
    problems = []
    if len(ours) != len(ref):
        return [(-1, f"{len(ours)} rows vs {len(ref)}")]
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a.tokens != b.tokens:
            problems.append((i, f"tokens {a.tokens} vs {b.tokens}"))
            continue
        if a.finish != b.finish:
            problems.append((i, f"finish {a.finish} vs {b.finish}"))
        for s, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            if x.dtype != y.dtype or not mx.array_equal(x, y).item():
                d = mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item()
                problems.append((i, f"step {s}: logprobs differ (max |d| {d:.3g}, "
                                    f"{x.dtype} vs {y.dtype})"))
                break
    return problems
