"""engine.fast.batch_decode: the L3 decode step for rows of the continuous batch.

Its exactness against mlx-lm's BatchGenerator is tests/parity/test_fast_batch_parity.py.
Here the mechanics, each against our own L1 rows (`mx.array_equal` on the CPU, where the
kernels' stand-ins run): the caches stay valid BatchKVCache objects step by step (rows
joining and leaving, their extracted KV equal to L1's), a row reaching the buffer's
capacity (growth to the next 512 columns), one trace per (rows, capacity) reused and
bounded, and the cases that stay on L1 with a reason.
"""

import random

import mlx.core as mx
import pytest

import engine
from engine import Engine
from engine.step.batch import BatchRequest, BatchScheduler
from engine.kv.batch_cache import BatchKVCache, BatchRotatingKVCache
from engine.fast.apply import batch_decoder_for, describe
from engine.fast.batch_decode import CAPACITY_STEP, FastBatchDecoder, why_not_caches
from engine.kv.quant import make_policy
from engine.levers import parse_spec
from parity.batch import Insert, compare, run_ours
from parity.fixtures.models import ensure_fixture

FAST_BATCH = parse_spec("l3+fast_batch")


def _model(family="llama", dtype="bfloat16"):
    return engine.load(str(ensure_fixture(family, dtype)))


def _prompt(rng, n):
    return [rng.randrange(4, 900) for _ in range(n)]


def _lockstep(model, dec, plan, steps):
    """Two schedulers, L1 and fast, fed the same requests (plan: {step: [(prompt, n)]},
    cancels as {step: [k]}); after every step their events and every live row's KV must
    be equal. Returns the number of events compared."""
    a = BatchScheduler(model, eos_token_ids=(), completion_batch_size=4, prefill_batch_size=4)
    b = BatchScheduler(model, eos_token_ids=(), completion_batch_size=4, prefill_batch_size=4,
                       decoder=dec)
    uids, seen = [], 0
    for step in range(steps):
        for prompt, n in plan.get(step, ()):
            ua = a.submit(BatchRequest(prompt, max_tokens=n))
            assert b.submit(BatchRequest(prompt, max_tokens=n)) == ua
            uids.append(ua)
        for k in plan.get(("cancel", step), ()):
            assert a.cancel(uids[k]) and b.cancel(uids[k])
        ea, eb = a.step(), b.step()
        assert [(e.uid, e.token, e.finish_reason) for e in ea] == \
               [(e.uid, e.token, e.finish_reason) for e in eb]
        for x, y in zip(ea, eb):
            if x.logprobs is not None:
                assert mx.array_equal(x.logprobs, y.logprobs).item()
                seen += 1
        for u in uids:
            ca, cb = a.row_caches(u), b.row_caches(u)
            assert (ca is None) == (cb is None)
            for p, q in zip(ca or (), cb or ()):
                assert p.offset == q.offset
                assert mx.array_equal(p.keys, q.keys).item()
                assert mx.array_equal(p.values, q.values).item()
        if not a.has_work() and step > max(k for k in plan if isinstance(k, int)):
            assert not b.has_work()
            break
    return seen


def test_rows_join_leave_and_abort_keep_the_caches_valid():
    model, _ = _model("qwen3", "bfloat16")
    dec = FastBatchDecoder(model, FAST_BATCH)
    rng = random.Random(1)
    plan = {0: [(_prompt(rng, 12), 8), (_prompt(rng, 30), 16)],
            3: [(_prompt(rng, 5), 4)],
            5: [(_prompt(rng, 21), 12), (_prompt(rng, 2), 9)],
            ("cancel", 9): [3]}
    assert _lockstep(model, dec, plan, 60) >= 30     # (49 tokens asked, one row aborted)
    assert dec.stats.steps > 10 and dec.stats.fallbacks == 0
    assert len({k[0] for k in dec.trace_keys}) >= 3         # B changed along the way


def test_a_row_reaching_capacity_grows_the_buffer():
    model, _ = _model("llama", "float32")
    dec = FastBatchDecoder(model, FAST_BATCH)
    rng = random.Random(2)
    # 505 + 24 columns: the write column crosses 512 while both rows decode
    plan = {0: [(_prompt(rng, 505), 24), (_prompt(rng, 40), 20)]}
    assert _lockstep(model, dec, plan, 60) == 44
    caps = sorted({k[1] for k in dec.trace_keys})
    assert caps == [CAPACITY_STEP, 2 * CAPACITY_STEP]


def test_one_trace_per_rows_and_capacity_reused_and_bounded():
    model, _ = _model("llama", "bfloat16")
    rng = random.Random(3)
    p = [_prompt(rng, n) for n in (7, 19, 11, 3)]
    schedule = [Insert(0, p[0], 12), Insert(1, p[1], 6), Insert(2, p[2], 9), Insert(8, p[3], 5)]
    kw = dict(completion_batch_size=4, prefill_batch_size=4)
    ref = run_ours(model, schedule, **kw)               # L1 rows
    dec = FastBatchDecoder(model, FAST_BATCH)
    assert not compare(run_ours(model, schedule, decoder=dec, **kw), ref)
    built = dec.stats.traces
    assert built == len(dec.trace_keys) == len(set(dec.trace_keys)) >= 3
    assert not compare(run_ours(model, schedule, decoder=dec, **kw), ref)
    assert dec.stats.traces == built                    # the same shapes: reused
    small = FastBatchDecoder(model, FAST_BATCH, max_traces=2)
    assert not compare(run_ours(model, schedule, decoder=small, **kw), ref)
    assert small.stats.traces_kept == len(small.trace_keys) == 2
    assert small.stats.traces >= built                  # evicted shapes are traced again
    with pytest.raises(ValueError, match="max_traces"):
        FastBatchDecoder(model, FAST_BATCH, max_traces=0)


def test_engine_takes_the_batch_step_only_when_asked():
    model, tok = _model("llama", "bfloat16")
    assert Engine(model, tok, max_batch=4, levers=parse_spec("l3")).batch_decoder is None
    assert Engine(model, tok, max_batch=4,
                  levers=parse_spec("l1+fast_batch")).batch_decoder is None   # no fast lever
    eng = Engine(model, tok, max_batch=4, levers=FAST_BATCH)
    assert isinstance(eng.batch_decoder, FastBatchDecoder)
    assert Engine(model, tok, max_batch=1, levers=FAST_BATCH).batch_decoder is None
    eng.submit("hello there", engine.SamplingParams(max_tokens=6, temperature=0.0))
    eng.submit("count to ten", engine.SamplingParams(max_tokens=6, temperature=0.0))
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert [o.finish_reason for o in done] == ["length", "length"]
    st = describe(FAST_BATCH, model)["fast_batch_stats"]
    assert st["steps"] >= 5 and st["fallbacks"] == 0


def test_models_and_caches_it_does_not_cover_stay_on_l1_with_a_reason():
    gemma, tok = _model("gemma3_text", "bfloat16")
    assert batch_decoder_for(gemma, FAST_BATCH) is None
    with pytest.raises(ValueError, match="gemma3|fast decode|sliding"):
        FastBatchDecoder(gemma, FAST_BATCH)
    eng = Engine(gemma, tok, max_batch=4, levers=FAST_BATCH)
    assert eng.batch_decoder is None
    model, _ = _model("llama", "bfloat16")
    assert batch_decoder_for(model, FAST_BATCH, make_policy(model, kv_bits=8)) is None
    assert batch_decoder_for(model, FAST_BATCH) is not None
    # caches: per step, whatever is not BatchKVCache (or holds nothing yet) goes to L1
    assert "BatchKVCache" in why_not_caches([BatchRotatingKVCache(64, [0])])
    assert "empty" in why_not_caches([BatchKVCache([0])])
    assert why_not_caches([]) == "no caches"
    dec = FastBatchDecoder(model, FAST_BATCH)
    assert not dec.covers([BatchRotatingKVCache(64, [0])] * len(model.layers))
    assert dec.stats.fallbacks == 1 and "BatchKVCache" in dec.stats.fallback_reason
    full = BatchKVCache([0])
    full.keys = full.values = mx.zeros((1, 2, 4, 8))
    assert not dec.covers([full])                      # one cache for several layers
    assert "layers" in dec.stats.fallback_reason


def test_batch_cache_reserve_and_advance():
    c = BatchKVCache([2, 0])
    k = mx.arange(2 * 1 * 5 * 4, dtype=mx.float32).reshape(2, 1, 5, 4)
    c.update_and_fetch(k, k)
    assert (c.write_column, c.capacity) == (5, 256)
    c.reserve(512)
    assert c.capacity == 512 and mx.array_equal(c.keys[..., :5, :], k).item()
    assert not c.keys[..., 5:, :].any().item()
    with pytest.raises(ValueError, match="filled"):
        c.reserve(4)
    with pytest.raises(ValueError, match="shape"):
        c.advance(k, k, c.offset)
    nk = c.keys
    c.advance(nk, nk, c.offset + 1)
    assert c.write_column == 6 and c.offset.tolist() == [4, 6]
    assert c.extract(0).keys.shape[2] == 4 and c.extract(1).keys.shape[2] == 6
    with pytest.raises(ValueError, match="offset"):
        c.advance(nk, nk, mx.array([1], dtype=mx.int32))
    with pytest.raises(ValueError, match="tokens"):
        BatchKVCache([0]).reserve(512)
