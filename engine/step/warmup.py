"""Build the fast runner's shapes before requests arrive (`warm_up(engine)`).

The fast runner compiles its kernels (NVRTC: the one-kernel step once per rows-a-call count,
a large build for an 8B model) and traces its step (`mx.compile`) the first time it meets a
rows bucket. On a fresh engine-serve that happened while the first requests waited: on an
H100, 16 concurrent requests to a new 8B 4-bit `--tier l3` server got their first token after
52-93 s (reports/bench_server/0.5.0/h100-8b-q4-l3/stall_probe.md). `warm_up` decodes a few
throw-away rows at each rows bucket up to `max_batch` through the Engine's own public
`submit`/`step` (so every path a request takes is built: prefill, join, each bucket's step,
the one kernel's builds) and puts the Engine's lane counters back as they were; engine-serve
runs it before it says ready (`--warm-up`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.step.request import SamplingParams


@dataclass(frozen=True)
class WarmUp:
    buckets: tuple          # the rows buckets decoded
    seconds: float
    traces: int             # traces the fast runner made during the warm-up


def buckets_for(engine) -> tuple:
    """The distinct rows buckets the fast runner meets for 1..max_batch rows, each with the
    most rows that land in it (empty without a fast runner)."""
    step = engine.fast_step
    if step is None:
        return ()
    top: dict = {}
    for n in range(1, engine.max_batch + 1):
        top[step.rows_for(n)] = n
    return tuple(sorted(top.values()))


def warm_up(engine, prompt_len: int = 8, tokens: int = 3) -> WarmUp:
    """Decode `tokens` tokens for n throw-away rows (greedy, prompts of `prompt_len` tokens)
    for each n of `buckets_for(engine)`, one group after another; returns what was built.
    Nothing to do (and nothing done) without a fast runner."""
    rows = buckets_for(engine)
    if not rows:
        return WarmUp((), 0.0, 0)
    step = engine.fast_step
    t0, traces0 = time.perf_counter(), step.stats.traces
    lanes, reasons = dict(engine.lanes), dict(engine.solo_reasons)
    # (the throw-away prompts are not kept in the prompt caches)
    caches = engine.prompt_cache, engine.disk_cache
    engine.prompt_cache = engine.disk_cache = None
    vocab = max(2, min(engine.vocab_size, 1000))
    try:
        for n in rows:
            for i in range(n):
                ids = [(7 * i + 3 * j + 1) % vocab for j in range(prompt_len)]
                engine.submit(ids, SamplingParams(max_tokens=tokens, temperature=0.0))
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.prompt_cache, engine.disk_cache = caches
        engine.lanes, engine.solo_reasons = lanes, reasons
    return WarmUp(rows, time.perf_counter() - t0, step.stats.traces - traces0)
