"""The needle runs of deterministic mode (docs/deterministic.md): one prompt decoded alone,
then as one row among other rows that join and leave mid-flight, compared bit for bit.

Shared by the CPU tests (tests/engine/test_deterministic.py) and the GPU run
(experiments/deterministic_gpu.py), so both prove the same thing the same way.

- `drive(engine, plan, abort_at)`: submit each plan entry at its step, step the engine to the
  end; per entry (tokens, logprob vectors).
- `crowd(rng, target, others)`: the target among `others` random rows (prompt lengths,
  join steps, max_tokens; one row aborted mid-flight).
- `needle(make_engine, alone_engine, target, rng)`: [(others, same as alone)] for 1, 7, 31.
- `same(a, b)`: tokens equal and every logprob vector `mx.array_equal`.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import mlx.core as mx

from engine import SamplingParams

GREEDY = SamplingParams(max_tokens=14, temperature=0.0)
OTHERS = (1, 7, 31)


def ids(rng: random.Random, lo: int, hi: int) -> list:
    """A random prompt of lo..hi token ids in [4, 1000)."""
    return [rng.randrange(4, 1000) for _ in range(rng.randint(lo, hi))]


def drive(eng, plan, abort_at=None):
    """plan: [(step, prompt, params)] submitted at that step, in list order. abort_at:
    (step, plan index) aborted then. Returns per plan entry (tokens, logprob vectors)."""
    rids, out, step = {}, {}, 0
    last = max(p[0] for p in plan)
    while step <= last or eng.has_unfinished():
        for k, (at, prompt, params) in enumerate(plan):
            if at == step:
                rids[k] = eng.submit(prompt, params)
                out[rids[k]] = ([], [])
        if abort_at is not None and abort_at[0] == step and abort_at[1] in rids:
            eng.abort(rids[abort_at[1]])
        for o in eng.step():
            if o.error is not None:
                raise RuntimeError(o.error)
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprob_arrays)
        step += 1
    return [out[rids[k]] for k in range(len(plan))]


def same(a, b) -> bool:
    return (a[0] == b[0] and len(a[1]) == len(b[1]) == len(a[0])
            and all(mx.array_equal(x, y).item() for x, y in zip(a[1], b[1])))


def crowd(rng: random.Random, target: Sequence[int], others: int, params=GREEDY):
    """The target among `others` rows: random prompt lengths (1..60 tokens), join steps
    (0..12), max_tokens (1..30), the target joining at step 2 at a random place among the
    rows joining then; returns (plan, the target's index, a row to abort mid-flight)."""
    plan = [(rng.randint(0, 12), ids(rng, 1, 60),
             SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0))
            for _ in range(others)]
    at = rng.randint(0, len(plan))
    plan.insert(at, (2, target, params))
    plan.sort(key=lambda p: p[0])           # (stable: the target keeps its place)
    t = next(i for i, p in enumerate(plan) if p[1] is target)
    victim = (rng.randint(3, 10), (t + 1) % len(plan)) if others > 1 else None
    return plan, t, victim


def needle(make_engine: Callable, alone_engine, target, rng: random.Random, others=OTHERS,
           params=GREEDY):
    """[(others, whether the target's tokens and logprobs equal its run alone)] for each
    count of other rows; `make_engine()` makes a fresh batching engine for each."""
    alone = drive(alone_engine, [(0, target, params)])[0]
    if not alone[0]:
        raise RuntimeError("the target decoded no token alone")
    result = []
    for n in others:
        plan, t, victim = crowd(rng, target, n, params)
        got = drive(make_engine(), plan, victim)[t]
        result.append((n, same(got, alone)))
    return result
