"""L1 through the public `Engine` API: `Engine.load(path, max_batch=1)` gives exactly
mlx-lm's `generate_step` (tokens and every step's logprob vector), `max_batch=N` with
N prompts submitted before the first step gives exactly mlx-lm 0.32.2's
`BatchGenerator` at B=N, and `abort` mid-generation equals `BatchGenerator.remove`
at the same step. `mx.array_equal` only."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as ref_generate_step

from engine import Engine
from parity.batch import Insert, RowResult, compare, run_engine, run_mlx_lm
from parity.fixtures.models import ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity

FAMILIES = ["llama", "gemma4_text"]


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(4, 900) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _engine(family, **kw):
    path = str(ensure_fixture(family, "float32"))
    eng = Engine.load(path, keep_logprob_arrays=True, **kw)
    return eng, oracle.load_model(path)


def _drive(eng, prompts, max_tokens, abort_at=None):
    """Submit every prompt, then step; abort_at {index: step}. Per prompt: (tokens,
    logprobs, finish reason)."""
    rows = run_engine(eng, [Insert(0, p, m, cancel_step=(abort_at or {}).get(i))
                            for i, (p, m) in enumerate(zip(prompts, max_tokens))])
    return [(r.tokens, r.logprobs, r.finish) for r in rows]


def _eos_free(eng, ref_rows):
    for r in ref_rows:
        assert not set(r.tokens) & eng.eos, "fixture produced EOS: pick other prompts"


@pytest.mark.parametrize("family", FAMILIES)
def test_max_batch_1_equals_generate_step(family):
    eng, ref_model = _engine(family, max_batch=1)
    for prompt in _prompts(2, seed=3):
        ((toks, lps, fin),) = _drive(eng, [prompt], [12])
        ref = list(ref_generate_step(mx.array(prompt), ref_model, max_tokens=12))
        assert not {int(t) for t, _ in ref} & eng.eos
        assert toks == [int(t) for t, _ in ref] and fin == "length"
        assert len(lps) == len(ref)
        for a, (_, b) in zip(lps, ref):
            assert mx.array_equal(a, b).item()
    assert eng.stats()["solo_reasons"] == {"max_batch=1": 2}


@pytest.mark.parametrize("family", FAMILIES)
def test_max_batch_n_equals_batch_generator(family):
    n = 4
    eng, ref_model = _engine(family, max_batch=n)
    prompts, mts = _prompts(n, seed=5), [9, 14, 6, 11]
    ref = run_mlx_lm(ref_model, [Insert(0, p, m) for p, m in zip(prompts, mts)],
                     completion_batch_size=n, prefill_batch_size=n)
    _eos_free(eng, ref)
    got = _drive(eng, prompts, mts)
    problems = compare([RowResult(t, l, f) for t, l, f in got], ref)
    assert not problems, problems[:3]
    st = eng.stats()
    assert st["lanes"] == {"batch": n, "solo": 0} and st["peak_rows"] == n


def _abort_case(abort_step):
    """3 rows; mlx-lm removes row 1 before loop step 5, the Engine aborts it before
    `abort_step`. Returns (ours, reference, engine)."""
    n = 3
    eng, ref_model = _engine("llama", max_batch=n)
    prompts, mts = _prompts(n, seed=7), [12, 12, 12]
    sched = [Insert(0, p, m) for p, m in zip(prompts, mts)]
    sched[1].cancel_step = 5
    ref = run_mlx_lm(ref_model, sched, completion_batch_size=n, prefill_batch_size=n)
    _eos_free(eng, ref)
    got = _drive(eng, prompts, mts, abort_at={1: abort_step})
    return got, ref, eng


def test_abort_mid_generation_equals_batch_generator_remove():
    got, ref, eng = _abort_case(5)
    assert got[1][2] == ref[1].finish == "cancelled"
    assert 0 < len(got[1][0]) < 12
    problems = compare([RowResult(t, l, f) for t, l, f in got], ref)
    assert not problems, problems[:3]
    assert not eng.has_unfinished() and not eng.abort("0")


def test_negative_control_abort_one_step_later_differs():
    """The abort test can fail: aborting a step later gives the row one more token."""
    got, ref, _ = _abort_case(6)
    assert compare([RowResult(t, l, f) for t, l, f in got], ref)


def test_rows_ending_at_their_first_token_equal_batch_generator():
    """A batch row's first token goes out in the step it graduates (`first_at_graduate`); a
    row that ends there still runs in the next decode forward beside the others, as in
    BatchGenerator, so the others' values stay its: rows of max_tokens 1 joining at the
    start and while others decode."""
    n = 4
    eng, ref_model = _engine("llama", max_batch=n)
    p = _prompts(6, seed=11)
    sched = [Insert(0, p[0], 10), Insert(0, p[1], 1), Insert(3, p[2], 1), Insert(3, p[3], 8),
             Insert(6, p[4], 1), Insert(9, p[5], 1)]
    ref = run_mlx_lm(ref_model, sched, completion_batch_size=n, prefill_batch_size=n)
    _eos_free(eng, ref)
    got = run_engine(eng, sched)
    problems = compare(got, ref)
    assert not problems, problems[:3]
    assert [len(r.tokens) for r in got] == [10, 1, 1, 8, 1, 1]
