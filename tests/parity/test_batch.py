"""L1 batched parity: `engine.step.batch.BatchScheduler` vs mlx-lm 0.32.2's `BatchGenerator`.

The same prompts are inserted at the same loop steps on both engines; every
row's tokens, finish reason and per-step logprob vectors must be identical
(`mx.array_equal`). Schedules cover rows joining mid-flight (into a prefill in
progress and into running decodes), chunked prefill (prefill_step_size 16),
rows leaving early (per-row stop token, short max_tokens, cancel), prompts and
generations longer than the Gemma fixtures' 16-token sliding window (ring wrap),
seeded sampling (global PRNG) with shared and mixed per-row samplers, and
per-row logits processors. Negative controls show the comparison can fail.
"""

import random

import mlx.core as mx
import pytest

from engine.loader import load_model
from parity.batch import Insert, compare, run_mlx_lm, run_ours
from parity.fixtures.models import FAMILIES, MOE, ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity

STEP = 16   # prefill chunk, == the Gemma fixtures' sliding window


def _models(family, dtype="float32"):
    path = str(ensure_fixture(family, dtype))
    return load_model(path)[0], oracle.load_model(path)


def _prompt(rng, n):
    return [rng.randrange(4, 1000) for _ in range(n)]


def _schedule(seed=0, stops=None):
    """7 rows: 3 at once, 2 joining at step 3 (one prefill still running), 2 at step 6;
    lengths 1..60 (> window), max_tokens 6..20 (prompt + output > window)."""
    rng = random.Random(seed)
    rows = [Insert(0, _prompt(rng, 7), 12), Insert(0, _prompt(rng, 19), 20),
            Insert(0, _prompt(rng, 40), 9), Insert(3, _prompt(rng, 33), 15),
            Insert(3, _prompt(rng, 5), 10), Insert(6, _prompt(rng, 60), 8),
            Insert(6, _prompt(rng, 1), 6)]
    for i, tok in (stops or {}).items():
        rows[i].stop_token = tok
    return rows


def _check(ours, ref):
    problems = compare(ours, ref)
    assert not problems, problems[:3]


# MoE families: bf16 activations over 4-bit experts instead of bf16 weights (CPU gather_mm is f32-only)
GREEDY = [(f, d) for f in FAMILIES for d in ("float32", "q4" if f in MOE else "bfloat16")]


@pytest.mark.parametrize("family,dtype", GREEDY, ids=[f"{d}-{f}" for f, d in GREEDY])
def test_greedy_schedule(family, dtype):
    ours_m, ref_m = _models(family, dtype)
    if family.startswith("gemma4"):   # prompts (40, 60) and prompt+output exceed the window
        assert FAMILIES["gemma4_text"]["sliding_window"] == 16 < 40
    ref = run_mlx_lm(ref_m, _schedule(), prefill_step_size=STEP)
    _check(run_ours(ours_m, _schedule(), prefill_step_size=STEP), ref)
    assert [len(r.tokens) for r in ref] == [12, 20, 9, 15, 10, 8, 6]
    # rows leaving early on a stop token: rows 1 and 3 stop at the token they
    # produced at step 4 / 2 above (so they leave while others keep decoding)
    stops = {1: ref[1].tokens[4], 3: ref[3].tokens[2]}
    ref2 = run_mlx_lm(ref_m, _schedule(stops=stops), prefill_step_size=STEP)
    assert ref2[1].finish == "stop" and len(ref2[1].tokens) <= 5
    assert ref2[3].finish == "stop" and len(ref2[3].tokens) <= 3
    _check(run_ours(ours_m, _schedule(stops=stops), prefill_step_size=STEP), ref2)


@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_cancel_mid_flight(family):
    ours_m, ref_m = _models(family)
    sched = _schedule(seed=1)
    sched[1].cancel_step = 5     # decoding
    sched[5].cancel_step = 7     # still prefilling its 60-token prompt
    sched[6].cancel_step = 6     # queued: cancelled right after it was inserted
    ref = run_mlx_lm(ref_m, sched, prefill_step_size=STEP)
    ours = run_ours(ours_m, sched, prefill_step_size=STEP)
    _check(ours, ref)
    assert [ours[i].finish for i in (1, 5, 6)] == ["cancelled"] * 3
    assert ours[6].tokens == [] and ours[5].tokens == []


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma4_text", "gemma4"])
@pytest.mark.parametrize("temps", [(0.8,) * 4, (0.0, 0.7, 1.0, 0.7)], ids=["shared", "mixed"])
def test_sampled_global_seed(family, temps):
    """Sampled rows with mx.random.seed: one batched sampler call when every row
    shares the sampler, one call per row otherwise (mlx-lm's PRNG order)."""
    ours_m, ref_m = _models(family)
    rng = random.Random(2)
    sched = [Insert(0, _prompt(rng, 7), 12, temp=temps[0]),
             Insert(0, _prompt(rng, 19), 20, temp=temps[1]),
             Insert(2, _prompt(rng, 40), 9, temp=temps[2]),
             Insert(4, _prompt(rng, 3), 9, temp=temps[3])]
    mx.random.seed(11)
    ref = run_mlx_lm(ref_m, sched, prefill_step_size=STEP)
    mx.random.seed(11)
    _check(run_ours(ours_m, sched, prefill_step_size=STEP), ref)


@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_logits_processors_per_row(family):
    ours_m, ref_m = _models(family)
    rng = random.Random(3)
    sched = [Insert(0, _prompt(rng, 9), 14, processors=dict(repetition_penalty=1.5)),
             Insert(0, _prompt(rng, 23), 10),
             Insert(2, _prompt(rng, 30), 12, processors=dict(presence_penalty=0.7,
                                                            logit_bias={17: 4.0}))]
    ref = run_mlx_lm(ref_m, sched, prefill_step_size=STEP)
    _check(run_ours(ours_m, sched, prefill_step_size=STEP), ref)


@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logit_bias_rows_batched(family, dtype):
    """Rows whose processors are logit biases only take the one-scatter path; mixed with
    a row without processors and a row with bias + penalty, joining and leaving."""
    ours_m, ref_m = _models(family, dtype)
    rng = random.Random(5)
    sched = [Insert(0, _prompt(rng, 12), 9, processors=dict(logit_bias={17: 4.0, 3: -2.5})),
             Insert(0, _prompt(rng, 7), 14, processors=dict(logit_bias={17: -100.0})),
             Insert(1, _prompt(rng, 20), 6),
             Insert(3, _prompt(rng, 5), 11, processors=dict(logit_bias={40: 3.0, 17: 1.5},
                                                           frequency_penalty=0.4)),
             Insert(5, _prompt(rng, 9), 8, processors=dict(logit_bias={0: 2.0}))]
    ref = run_mlx_lm(ref_m, sched, prefill_step_size=STEP)
    _check(run_ours(ours_m, sched, prefill_step_size=STEP), ref)


def test_small_batch_limits():
    """prefill_batch_size 2 / completion_batch_size 3: rows wait in the queue."""
    ours_m, ref_m = _models("gemma4_text", "bfloat16")
    kw = dict(prefill_step_size=STEP, prefill_batch_size=2, completion_batch_size=3)
    ref = run_mlx_lm(ref_m, _schedule(seed=4), **kw)
    _check(run_ours(ours_m, _schedule(seed=4), **kw), ref)


# --- negative controls: the comparison must be able to fail ---------------------------


@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_negative_control_weight_ulp(family):
    """One weight tensor moved by one ulp in our model -> some logprobs differ."""
    ours_m, ref_m = _models(family)
    ref = run_mlx_lm(ref_m, _schedule(), prefill_step_size=STEP)
    layer = ours_m.layers[0]
    w = layer.mlp.down_proj.weight
    assert w.dtype == mx.float32
    layer.mlp.down_proj.weight = (w.view(mx.int32) + 1).view(mx.float32)
    try:
        assert compare(run_ours(ours_m, _schedule(), prefill_step_size=STEP), ref)
    finally:
        layer.mlp.down_proj.weight = w
    assert not compare(run_ours(ours_m, _schedule(), prefill_step_size=STEP), ref)


def test_negative_control_no_roll(monkeypatch):
    """Skipping the roll to left padding after a right-padded chunk breaks parity."""
    import engine.kv.batch_cache as bc
    ours_m, ref_m = _models("gemma4_text")
    ref = run_mlx_lm(ref_m, _schedule(), prefill_step_size=STEP)
    monkeypatch.setattr(bc, "roll_rows", lambda x, shifts, axis=2: x)
    assert compare(run_ours(ours_m, _schedule(), prefill_step_size=STEP), ref)
