"""The fast runner (L3): engine.fast.decode.FastStep over engine.fast.slots.SlotPool.

Its exactness against mlx-lm's BatchGenerator is tests/parity/test_fast_batch_parity.py.
Here the mechanics, each against our own L1 rows (`mx.array_equal` on the CPU, where the
kernels' stand-ins run): rows joining and leaving (each row's extracted KV equal to L1's),
a row reaching the buffers' capacity, slots reused and the buffers shrunk, one trace per
(rows bucket, capacity) reused and bounded, no trace at all once the shapes of a traffic
pattern have been seen, and the cases that stay on L1 with a reason.
"""

import random

import mlx.core as mx
import pytest

import engine
from engine import Engine
from engine.step.batch import BatchRequest, BatchScheduler
from engine.fast.apply import describe, fast_step_for
from engine.fast.decode import CAPACITY_STEP, FastStep
from engine.fast.slots import SlotPool
from engine.kv.quant import make_policy
from engine.levers import parse_spec
from parity.batch import Insert, compare, run_ours
from parity.fixtures.models import ensure_fixture

FAST = parse_spec("l3")


def _model(family="llama", dtype="bfloat16"):
    return engine.load(str(ensure_fixture(family, dtype)))


def _prompt(rng, n):
    return [rng.randrange(4, 900) for _ in range(n)]


def _lockstep(model, step, plan, steps, batch=4):
    """Two schedulers, L1 and fast, fed the same requests (plan: {step: [(prompt, n)]},
    cancels as {("cancel", step): [k]}); after every step their events and every live row's
    KV must be equal. Returns (events compared, the fast scheduler)."""
    a = BatchScheduler(model, eos_token_ids=(), completion_batch_size=batch, prefill_batch_size=4)
    b = BatchScheduler(model, eos_token_ids=(), completion_batch_size=batch, prefill_batch_size=4,
                       decoder=step)
    uids, seen = [], 0
    for i in range(steps):
        for prompt, n in plan.get(i, ()):
            ua = a.submit(BatchRequest(prompt, max_tokens=n))
            assert b.submit(BatchRequest(prompt, max_tokens=n)) == ua
            uids.append(ua)
        for k in plan.get(("cancel", i), ()):
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
        if not a.has_work() and i > max(k for k in plan if isinstance(k, int)):
            assert not b.has_work()
            break
    return seen, b


def test_rows_join_leave_and_abort_keep_the_kv_valid():
    model, _ = _model("qwen3", "bfloat16")
    step = FastStep(model, FAST)
    rng = random.Random(1)
    plan = {0: [(_prompt(rng, 12), 8), (_prompt(rng, 30), 16)],
            3: [(_prompt(rng, 5), 4)],
            5: [(_prompt(rng, 21), 12), (_prompt(rng, 2), 9)],
            ("cancel", 9): [3]}
    seen, sched = _lockstep(model, step, plan, 60)
    assert seen >= 30     # (49 tokens asked, one row aborted)
    assert step.stats.steps > 10
    assert len({k[0] for k in step.trace_keys}) >= 2         # the rows bucket changed
    assert {k[0] for k in step.trace_keys} <= {1, 2, 4}       # (powers of two only)


def test_a_row_reaching_capacity_grows_the_buffers():
    model, _ = _model("llama", "float32")
    step = FastStep(model, FAST)
    rng = random.Random(2)
    # 505 + 24 columns: the row's write column crosses 512 while both rows decode
    plan = {0: [(_prompt(rng, 505), 24), (_prompt(rng, 40), 20)]}
    assert _lockstep(model, step, plan, 60)[0] == 44
    caps = sorted({k[1] for k in step.trace_keys})
    assert caps == [CAPACITY_STEP, 2 * CAPACITY_STEP]


def test_slots_reused_lowest_first_and_buffers_shrink():
    model, _ = _model("llama", "bfloat16")
    step = FastStep(model, FAST)
    rng = random.Random(4)
    plan = {0: [(_prompt(rng, 9), 30), (_prompt(rng, 9), 4), (_prompt(rng, 9), 30)],
            8: [(_prompt(rng, 6), 5)]}
    seen, sched = _lockstep(model, step, plan, 10)
    pool = sched._decode.caches
    assert isinstance(pool, SlotPool)
    # row 1 finished after 4 tokens; the row that joined at step 8 took its slot (1)
    assert pool.slots == [0, 2, 1] and pool.rows == 4
    assert [step.rows_for(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]
    pool.filter([0])                      # rows 2 and 3 leave: slots 1 and 2 freed
    assert pool.rows == 1 and pool.slots == [0] and pool.held[0] > 9
    pool.filter([])
    assert pool.rows == 1 and pool.slots == [] and pool.held == [-1]


def test_row_buckets_follow_the_one_kernel_steps_rows_a_call():
    """Powers of two, capped at the rows one call of the one-kernel step takes while they
    fit one call (so an 8B model's 5 to 7 rows stay on the one kernel)."""
    model, _ = _model("llama", "bfloat16")
    step = FastStep(model, FAST)
    assert step.mega_rows == 0                                # (no CUDA here)
    ns = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 33)
    assert [step.rows_for(n) for n in ns] == [1, 2, 4, 8, 8, 8, 16, 16, 16, 32, 64]
    step.mega_rows = 8                                       # (as on a GPU: float, 1B)
    assert [step.rows_for(n) for n in ns] == [1, 2, 4, 8, 8, 8, 16, 16, 16, 32, 64]
    step.mega_rows = 7                                       # (8B: 7 rows a call)
    assert [step.rows_for(n) for n in ns] == [1, 2, 4, 7, 7, 8, 16, 16, 16, 32, 64]
    assert all(step.rows_for(n) >= n for n in range(1, 70))


def test_one_trace_per_shape_reused_and_bounded():
    model, _ = _model("llama", "bfloat16")
    rng = random.Random(3)
    p = [_prompt(rng, n) for n in (7, 19, 11, 3)]
    schedule = [Insert(0, p[0], 12), Insert(1, p[1], 6), Insert(2, p[2], 9), Insert(8, p[3], 5)]
    kw = dict(completion_batch_size=4, prefill_batch_size=4)
    ref = run_ours(model, schedule, **kw)               # L1 rows
    step = FastStep(model, FAST)
    assert not compare(run_ours(model, schedule, decoder=step, **kw), ref)
    built = step.stats.traces
    assert built == len(step.trace_keys) == len(set(step.trace_keys)) >= 2
    assert not compare(run_ours(model, schedule, decoder=step, **kw), ref)
    assert step.stats.traces == built                    # the same shapes: reused
    small = FastStep(model, FAST, max_traces=1)
    assert not compare(run_ours(model, schedule, decoder=small, **kw), ref)
    assert small.stats.traces_kept == len(small.trace_keys) == 1
    assert small.stats.traces > built                  # evicted shapes are traced again
    with pytest.raises(ValueError, match="max_traces"):
        FastStep(model, FAST, max_traces=0)


def test_serving_traffic_makes_no_new_trace_once_its_shapes_are_seen():
    """Random arrivals, lengths and finishes through an Engine: after a warm-up that has seen
    every rows bucket, more traffic of the same kind traces nothing (rows join and leave
    between steps; the shapes stay the buckets')."""
    model, tok = _model("llama", "bfloat16")
    eng = Engine(model, tok, max_batch=8, levers=FAST)

    def traffic(seed, n):
        rng = random.Random(seed)
        arrivals = sorted(rng.randrange(0, 60) for _ in range(n))
        step = 0
        while arrivals or eng.has_unfinished():
            while arrivals and arrivals[0] <= step:
                arrivals.pop(0)
                eng.submit(_prompt(rng, rng.randrange(2, 60)),
                           engine.SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0))
            eng.step()
            step += 1

    for b in (1, 2, 4, 8):                  # warm-up: every bucket once
        for i in range(b):
            eng.submit(_prompt(random.Random(i), 5), engine.SamplingParams(max_tokens=3))
        while eng.has_unfinished():
            eng.step()
    traffic(10, 30)
    before = eng.fast_step.stats.traces
    assert before >= 4
    traffic(11, 40)
    traffic(12, 40)
    st = eng.stats()
    assert st["peak_rows"] >= 5
    assert st["fast"]["traces"] == before == eng.fast_step.stats.traces
    assert st["fast"]["steps"] > 100


def test_engine_runs_every_row_on_the_fast_runner_with_a_fast_lever():
    model, tok = _model("llama", "bfloat16")
    assert Engine(model, tok, max_batch=4).fast_step is None
    assert Engine(model, tok, max_batch=4, levers=parse_spec("l1+merged_proj")).fast_step is None
    for mb in (1, 4):
        eng = Engine(model, tok, max_batch=mb, levers=FAST)
        assert isinstance(eng.fast_step, FastStep)
        eng.submit("hello there", engine.SamplingParams(max_tokens=6, temperature=0.0))
        eng.submit("count to ten", engine.SamplingParams(max_tokens=6, temperature=0.0))
        done = []
        while eng.has_unfinished():
            done += [o for o in eng.step() if o.finished]
        assert [o.finish_reason for o in done] == ["length", "length"]
        assert eng.stats()["lanes"] == {"batch": 2, "solo": 0}
    st = describe(FAST, model)["fast_stats"]
    assert st["steps"] >= 5


def test_models_it_does_not_cover_stay_on_l1_with_a_reason():
    gemma, tok = _model("gemma3_text", "bfloat16")
    assert fast_step_for(gemma, FAST) is None
    with pytest.raises(ValueError, match="gemma3|fast decode|sliding"):
        FastStep(gemma, FAST)
    eng = Engine(gemma, tok, max_batch=4, levers=FAST)
    assert eng.fast_step is None
    model, tok = _model("llama", "bfloat16")
    assert fast_step_for(model, FAST, make_policy(model, kv_bits=8)) is None
    assert fast_step_for(model, FAST) is fast_step_for(model, FAST)     # one per (model, levers)
    eng = Engine(model, tok, max_batch=4, levers=FAST, kv_bits=8)   # quantized KV: L1 rows
    assert eng.fast_step is None and eng.batching and eng.quant_rows


def test_admission_counts_every_row_of_the_bucket():
    """The fast runner holds KV for the whole bucket (3 rows run as 4): the aggregate
    admission counts 4, so a budget that fits 3 rows exactly on L1 holds the third back."""
    path = str(ensure_fixture("llama", "bfloat16"))
    l1 = Engine.load(path, max_batch=8)
    fast = Engine.load(path, max_batch=8, levers=FAST)
    need = 300
    adm = l1.admission
    lo, hi = adm.weights, adm.budget_bytes          # the smallest budget that fits 3 rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        adm.budget_bytes = mid
        lo, hi = (lo, mid) if l1.batch_fits([need] * 3) else (mid, hi)
    adm.budget_bytes = fast.admission.budget_bytes = hi
    assert l1.batch_fits([need] * 3) and not l1.batch_fits([need] * 4)
    assert fast.fast_step.rows_for(3) == 4
    assert not fast.batch_fits([need] * 3) and fast.batch_fits([need] * 2)


def test_long_and_short_rows_in_turn_make_no_new_trace():
    """Rows of many lengths joining and leaving, over and over: capacities are 512 x 2^k, so
    a server's shapes are few and all kept; the second and third rounds trace nothing (with
    512-column steps and 16 traces kept, every round traced again: a hostile probe found it)."""
    from engine.kv.batch_cache import batch_caches

    model, _ = _model("llama", "bfloat16")
    step = FastStep(model, FAST)
    pool = SlotPool(step, model)
    a0 = model.layers[0].self_attn

    def row(n):
        caches = model.make_cache()
        kv = mx.zeros((1, a0.n_kv_heads, n, a0.head_dim), mx.bfloat16)
        for c in caches:
            c.update_and_fetch(kv, kv)
        return batch_caches([caches])

    def round_():
        for k in range(1, 19):            # 502 .. 9206 tokens: capacities 512 .. 16384
            pool.extend(row(512 * k - 10))
            mx.eval(pool(mx.array([1])))
            pool.filter([])
    round_()
    first = step.stats.traces
    assert {k[1] for k in step.trace_keys} == {512, 1024, 2048, 4096, 8192, 16384}
    round_()
    round_()
    assert step.stats.traces == first
