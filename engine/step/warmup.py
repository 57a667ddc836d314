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

An engine whose batch rows speculate with a draft model (`Engine(draft_model=...)`) also
decodes throw-away speculating rows at each rows bucket of the draft's fast runner (where the
draft runs on L1: on CUDA, 1 and max_batch rows, at most L1_ROWS), joining one step apart and
leaving at different lengths, so that what a served burst meets first is built here: the
draft's catch-up and slot moves, verify forwards of every row count, rewinds, rows leaving.
Without it, on an H100 the first such steps of a fresh process took 2-7 s each (MLX compiling
their kernels; reports/spec_stalls/0.5.9/) and a served burst of 8 speculating clients got a
first token after 4.9 s (spec_bench's `ttft_max_ms`).

With `lookup` (engine-serve's `--prompt-lookup N`) it decodes throw-away prompt-lookup rows the
same way (repetitive prompts, so drafts are found), at each rows bucket of the fast runner
(where the rows' verify is a fast step of new row counts) or, on the L1 runner, 1 and max_batch.

On CUDA an engine with neither (the L1 runners: engine-serve's default) decodes throw-away rows
joining one step apart and leaving at different lengths, one row and `max_batch` rows (at most
L1_ROWS), for the same reason: in that H100 process the first prefill took 6.2 s and the first
row to leave the batch 2.1 s (MLX compiling their kernels), costs a fresh server's first
requests would otherwise pay. (On the CPU MLX compiles nothing at first use: those L1 bursts are
left out there unless asked for, `warm_up(..., l1=True)`.)

`long_prompt=N` (engine-serve: the longest prefix its `--prompt-cache-dir` holds, or
`--warm-up-tokens N`) then prefills one throw-away prompt of N tokens and decodes a token after
it: a fresh process's first long-context request pays for what it is the first to need (on an
H100 a 1B server's first 26K-token prefill took 1.2 s, its later ones 0.45 s; a restarted
server's first turn restored from disk took ~0.42 s beyond its read,
reports/prompt_cache_disk/JOURNAL.md), so the first agent turn after a restart does not.

`rehearse=[paths]` (engine-serve: that prefix's files) first runs once the attention calls a
next turn over that prefix would make (`bucketed_sdpa.warm_turns`: their cuDNN plans built
before the turn), then reads those disk prompt cache files once and drops what they hold. On
CUDA MLX's memory is unified: an array copied in from
the host into memory never touched before ran at 2.35 GB/s on the H100 host, into a buffer
MLX's cache kept from an earlier host copy of that size at 11.7 GB/s
(`experiments/restore_bound_probe.py`); the restart's first restore then copies into the
rehearsal's buffers (and reads the files from the page cache).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from engine.models.bucketed_sdpa import on_cuda, warm_turns
from engine.step.request import SamplingParams
from engine.step.speculation import Speculation


@dataclass(frozen=True)
class WarmUp:
    buckets: tuple          # the rows buckets decoded
    seconds: float
    traces: int             # traces the fast runner made during the warm-up
    draft_buckets: tuple = ()   # the speculating rows' counts decoded (a draft model's)
    l1_rows: tuple = ()         # the L1 batch's row counts decoded (no fast runner, no draft rows)
    lookup_buckets: tuple = ()  # the prompt-lookup rows' counts decoded (`lookup`)
    long_tokens: int = 0        # the long throw-away prompt's tokens (`long_prompt`; 0: none)
    rehearsed_bytes: int = 0    # the disk prompt cache files read once (`rehearse`)
    turn_shapes: int = 0        # attention calls of a next turn over that prefix run once


L1_ROWS = 8    # the L1 warm-up's most rows (a cap, so a large max_batch keeps the start short)


def _jit(l1: Optional[bool]) -> bool:
    """Whether the L1 paths' warm-up runs: `l1`, or by default on CUDA only (where MLX compiles
    its kernels at first use; on the CPU it would only lengthen the start)."""
    return on_cuda() if l1 is None else l1


def _l1_counts(engine) -> tuple:
    """Row counts of an L1 burst: one row and max_batch rows (at most L1_ROWS)."""
    return tuple(sorted({1, min(engine.max_batch, L1_ROWS)}))


def _buckets(step, max_batch: int) -> tuple:
    """The distinct rows buckets a fast runner's `step` meets for 1..max_batch rows, each with
    the most rows that land in it."""
    top: dict = {}
    for n in range(1, max_batch + 1):
        top[step.rows_for(n)] = n
    return tuple(sorted(top.values()))


def buckets_for(engine) -> tuple:
    """The distinct rows buckets the fast runner meets for 1..max_batch rows, each with the
    most rows that land in it (empty without a fast runner)."""
    step = engine.fast_step
    return () if step is None else _buckets(step, engine.max_batch)


def draft_buckets_for(engine, l1: Optional[bool] = None) -> tuple:
    """The speculating rows' counts the warm-up decodes: each rows bucket of the draft's fast
    runner up to max_batch (its most rows), or, where the draft runs on L1 and `_jit(l1)`, 1
    and max_batch (at most L1_ROWS); empty where the batch rows do not speculate with a draft
    model."""
    if not engine.draft_rows:
        return ()
    step = engine.draft_step
    if step is None:
        return _l1_counts(engine) if _jit(l1) else ()
    return _buckets(step, engine.max_batch)


def lookup_buckets_for(engine, lookup: int, l1: Optional[bool] = None) -> tuple:
    """The prompt-lookup rows' counts the warm-up decodes where requests look up (`lookup` > 0)
    as batch rows: each rows bucket of the fast runner, or on L1 where `_jit(l1)` 1 and
    max_batch (at most L1_ROWS); else none."""
    if not lookup or not engine.lookup_rows:
        return ()
    if engine.fast_step is None:
        return _l1_counts(engine) if _jit(l1) else ()
    return _buckets(engine.fast_step, engine.max_batch)


def verify_shapes(step, max_batch: int, k: int) -> list:
    """(call rows, slots) of every verify step of the fast runner's `step` for rows that draft
    up to k tokens: for each slots bucket of 1..max_batch rows, each call-rows bucket from one
    row without a draft (the others left, the last slot still held) to all of them with k."""
    out = set()
    for slots in {step.rows_for(n) for n in range(1, max_batch + 1)}:
        rows = min(slots, max_batch)
        for calls in range(1, rows * (k + 1) + 1):
            out.add((step.verify_rows_for(calls), slots))
    return sorted(out)


def _verify_warm_up(engine, k: int) -> None:
    """One throw-away verify step (`SlotPool.verify`) for each of `verify_shapes`, on a slot
    pool of its own (rows of one prompt token each): the shapes speculating rows meet on the
    fast runner are traced and their kernels built, whatever mix of drafts arrives."""
    import mlx.core as mx

    from engine.fast.slots import SlotPool
    step, model = engine.fast_step, engine.model
    for calls, slots in verify_shapes(step, engine.max_batch, k):
        rows = min(slots, engine.max_batch)
        pool = SlotPool.of_prompts(step, model, [[1]] * rows)
        n = min(calls, rows * (k + 1))            # (the bucket's most call rows these rows make)
        if n < rows:                              # (fewer rows: the others left, the last stays)
            pool.filter(list(range(n - 1)) + [rows - 1])
            rows = n
        lengths = [n // rows + (i < n % rows) for i in range(rows)]
        mx.eval(pool.verify(mx.ones((rows, k + 1), dtype=mx.int32), lengths))


def _traces(engine) -> int:
    return sum(s.stats.traces for s in (engine.fast_step, engine.draft_step) if s is not None)


def l1_rows_for(engine, l1: Optional[bool] = None) -> tuple:
    """The row counts the warm-up decodes on the L1 runners: 1 and max_batch (at most L1_ROWS)
    where there is neither a fast runner nor a draft model's batch rows (those warm-ups cover
    the batch's paths) and `_jit(l1)`, else none."""
    if not _jit(l1) or engine.fast_step is not None or engine.draft_rows:
        return ()
    return _l1_counts(engine)


def _staggered(engine, n: int, vocab: int, prompt_len: int, tokens: int, extra: int,
               period: int = 0, **kw) -> None:
    """n throw-away greedy rows, each submitted one step after the one before and asking for
    one more token, run to the end (rows join while others decode and leave one by one);
    `period`: their prompts repeat every that many tokens (0: they do not)."""
    for i in range(n):
        ids = [(5 * i + 3 * (j % period if period else j) + 2) % vocab for j in range(prompt_len + i)]
        engine.submit(ids, SamplingParams(max_tokens=tokens + extra + i, temperature=0.0, **kw))
        engine.step()
    while engine.has_unfinished():
        engine.step()


LONG_MAX = 32768       # the longest throw-away prompt (a start never prefills more: an 8B
                       # 4-bit model on an H100 prefills 24K tokens in ~3.5 s)


def warm_up(engine, prompt_len: int = 8, tokens: int = 3, draft_tokens: int = 4,
            l1: Optional[bool] = None, lookup: int = 0, long_prompt: int = 0,
            rehearse: Sequence = ()) -> WarmUp:
    """Decode `tokens` tokens for n throw-away rows (greedy, prompts of `prompt_len` tokens)
    for each n of `buckets_for(engine)`, one group after another; then, with a draft model,
    n speculating rows (`draft_tokens` drafts a step) for each n of `draft_buckets_for`,
    joining one step apart; with `lookup` (the n-gram), prompt-lookup rows the same way for
    each n of `lookup_buckets_for`; on the L1 runners alone, n rows joining one step apart for
    each n of `l1_rows_for` (`l1`: the L1 paths' warm-ups on or off; default: on CUDA only);
    then, where `_jit(l1)`, one throw-away prompt of `long_prompt` tokens (at most LONG_MAX)
    prefilled and a token decoded after it (0 or 1: none), and the disk prompt cache files
    `rehearse` read once (`rehearse_files`).
    Returns what was built; the engine's counters are left as they were."""
    rows, spec, plain = buckets_for(engine), draft_buckets_for(engine, l1), l1_rows_for(engine, l1)
    look = lookup_buckets_for(engine, lookup, l1)
    long_n = min(int(long_prompt), LONG_MAX) if long_prompt > 1 and _jit(l1) else 0
    files = tuple(rehearse) if _jit(l1) else ()
    if not rows and not spec and not plain and not look and not long_n and not files:
        return WarmUp((), 0.0, 0)
    t0, traces0 = time.perf_counter(), _traces(engine)
    lanes, reasons, spec_counts = dict(engine.lanes), dict(engine.solo_reasons), engine.spec
    steps, peak = engine.steps, engine.peak_rows
    engine.spec = Speculation()
    # (the throw-away prompts are not kept in the prompt caches)
    caches = engine.prompt_cache, engine.disk_cache
    engine.prompt_cache = engine.disk_cache = None
    vocab = max(2, min(engine.vocab_size, 1000))
    try:
        for n in rows:
            for i in range(n):
                ids = [(7 * i + 3 * j + 1) % vocab for j in range(prompt_len)]
                engine.submit(ids, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                  use_draft=False))
            while engine.has_unfinished():
                engine.step()
        if engine.fast_step is not None and (spec or look):
            _verify_warm_up(engine, draft_tokens)
        for n in spec:       # (rows join one step apart and leave at different lengths)
            _staggered(engine, n, vocab, prompt_len, tokens, 2 * n + draft_tokens + 2,
                       num_draft_tokens=draft_tokens)
        for n in look:       # (prompts repeating every 4 tokens: the rows find drafts)
            _staggered(engine, n, vocab, 4 * prompt_len, tokens, 2 * n + draft_tokens + 2,
                       period=4, prompt_lookup=lookup, num_draft_tokens=draft_tokens)
        for n in plain:      # (2n more tokens: the first row is still decoding when the last joins)
            _staggered(engine, n, vocab, prompt_len, tokens, 2 * n, use_draft=False)
        if long_n:           # (prefill, then a decode step over the long context)
            long_n = _submit_long(engine, long_n, vocab)
            while engine.has_unfinished():
                engine.step()
        # (the turn after a restart: a few hundred new tokens over the restored prefix; before
        # the rehearsal, whose freed buffers the first restore is to find in MLX's cache)
        turns = warm_turns(attention_shapes(engine.model), long_n) if files and long_n else 0
        rehearsed = rehearse_files(files)
    finally:
        engine.prompt_cache, engine.disk_cache = caches
        engine.lanes, engine.solo_reasons = lanes, reasons
        engine.spec = spec_counts      # (the throw-away rows' drafts: counted in a copy only)
        engine.steps, engine.peak_rows = steps, peak
    return WarmUp(rows, time.perf_counter() - t0, _traces(engine) - traces0, spec, plain, look,
                  long_n, rehearsed, turns)


def _submit_long(engine, n: int, vocab: int) -> int:
    """Submit the long throw-away prompt, at most what the model's context and the engine's
    memory admission take (shortened by a quarter until they do); the tokens submitted, 0
    when not even a short one fits."""
    from engine.step.request import PromptError
    ctx = getattr(engine, "max_context", None)
    n = min(n, ctx - 2) if ctx else n
    while n > 1:
        try:
            engine.submit([(3 * j + 1) % vocab for j in range(n)],
                          SamplingParams(max_tokens=2, temperature=0.0, use_draft=False))
            return n
        except (PromptError, ValueError):           # (over the context or the memory budget)
            n = n * 3 // 4
    return 0


def attention_shapes(model) -> list:
    """(heads, KV heads, head dim, activation dtype) of the model's attention layers, each
    once (layers without those attributes left out)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    floats = (mx.float32, mx.bfloat16, mx.float16)
    dtype = next((v.dtype for _, v in tree_flatten(model.parameters()) if v.dtype in floats),
                 mx.float16)
    out = []
    for layer in getattr(model, "layers", ()):
        attn = getattr(layer, "self_attn", None)
        dims = tuple(getattr(attn, k, None) for k in ("n_heads", "n_kv_heads", "head_dim"))
        if all(isinstance(d, int) for d in dims) and dims + (dtype,) not in out:
            out.append(dims + (dtype,))
    return out


def rehearse_files(paths) -> int:
    """Read disk prompt cache files (engine.kv.cache_file.decode_file: checked, copied into
    MLX's memory) and drop what they hold; the bytes read. Stops at the first that fails:
    the restore that meets it logs it and deletes it."""
    from engine.kv.cache_file import CacheFileError, decode_file
    done = 0
    for p in paths:
        try:
            size = os.path.getsize(p)
            decode_file(p)                  # (its arrays made, then dropped)
        except (OSError, CacheFileError, KeyError, ValueError):
            break
        done += size
    return done
