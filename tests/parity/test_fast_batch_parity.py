"""The fast runner (`--tier l3`: every row of the batch) against mlx-lm's BatchGenerator, exactly.

On the CPU the kernels' stock-MLX stand-ins run, and the fast runner (each row in a slot
of its own, from column 0, of buffers of 512-column multiples and a power-of-two number of
rows; per-row RoPE offsets and write columns; a masked SDPA) gives the same logprobs as our
L1 rows, bit for bit, and so as mlx-lm 0.32.2's
`BatchGenerator` driven with the same schedule (tests/parity/test_batch.py proves our L1
rows equal it). `mx.array_equal` on every step's logprobs and every token:

- llama and qwen3, float32 and bfloat16, rows joining at different steps and finishing at
  different lengths; one row aborted mid-generation;
- a negative control: each of the kernels' injected faults makes the same run differ
  (so the equalities above can fail).
"""

import random

import pytest

import engine
from engine import Engine
from engine.fast import kernels as K
from engine.levers import parse_spec
from parity.batch import Insert, compare, run_engine, run_mlx_lm
from parity.fixtures.models import ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity

FAST = parse_spec("l3")


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(4, 900) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _schedule(cancel: bool = False):
    p = _prompts(5, seed=5)
    # (the last row joins when two rows are left: with the batch full the Engine would
    # hold it back a step, which BatchGenerator does not)
    return [Insert(0, p[0], 9), Insert(0, p[1], 14, cancel_step=7 if cancel else None),
            Insert(2, p[2], 6), Insert(4, p[3], 11), Insert(12, p[4], 5)]


def _fast_engine(family, dtype):
    path = str(ensure_fixture(family, dtype))
    model, tok = engine.load(path)
    eng = Engine(model, tok, max_batch=4, keep_logprob_arrays=True, levers=FAST)
    assert eng.fast_step is not None, "the Engine did not take the fast runner"
    return eng, oracle.load_model(path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_batch_rows_equal_batch_generator(family, dtype):
    eng, ref_model = _fast_engine(family, dtype)
    schedule = _schedule()
    ref = run_mlx_lm(ref_model, schedule, completion_batch_size=4, prefill_batch_size=4)
    for r in ref:
        assert not set(r.tokens) & eng.eos, "fixture produced EOS: pick other prompts"
    problems = compare(run_engine(eng, schedule), ref)
    assert not problems, problems[:3]
    st = eng.fast_step.stats
    # every decode forward of the rows went through the fast step: one per emitted token
    # (the step is pipelined: a row's first forward is L1's, as it comes out of prefill,
    # and the step that emits its last token still runs one over it); idle slots of a
    # bucket count too
    assert st.row_steps >= sum(i.max_tokens for i in schedule) and st.steps > 0
    assert eng.stats()["lanes"] == {"batch": 5, "solo": 0}
    # float weights: the rows' projections went through engine.fast.gemv (its stock path here)
    assert st.gemv


def test_fast_batch_abort_mid_generation_equals_batch_generator():
    eng, ref_model = _fast_engine("qwen3", "bfloat16")
    schedule = _schedule(cancel=True)
    ref = run_mlx_lm(ref_model, schedule, completion_batch_size=4, prefill_batch_size=4)
    ours = run_engine(eng, schedule)
    assert ours[1].finish == "cancelled" and 0 < len(ours[1].tokens) < 14
    # the aborted row's tokens up to the abort; the rest, exactly
    assert ours[1].tokens == ref[1].tokens[:len(ours[1].tokens)]
    assert not compare(ours[:1] + ours[2:], ref[:1] + ref[2:])


@pytest.mark.parametrize("fault", K.FAULTS)
def test_negative_control_injected_faults_differ(fault):
    eng, ref_model = _fast_engine("llama", "bfloat16")
    schedule = _schedule()
    ref = run_mlx_lm(ref_model, schedule, completion_batch_size=4, prefill_batch_size=4)
    with K.inject_fault(fault):
        problems = compare(run_engine(eng, schedule), ref)
    assert problems, f"fault {fault} went unnoticed"
