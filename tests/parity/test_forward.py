"""L1 (and L2 for quantized sliding-window KV): our forward vs mlx-lm's, bit for bit.

Every family x weight dtype x prompt length, logits at the prefill and at each
of 32 greedy decode steps compared with `mx.array_equal`; quantized KV (8/4
bits, from the first token and from token 12) on the same schedule; and our
token loop against mlx-lm's own `generate_step` (tokens and logprobs).
"""

import mlx.core as mx
import numpy as np
import pytest

from engine.loader import load_model
from parity import checks
from parity.fixtures.models import FAMILIES, MOE, ensure_fixture

pytestmark = pytest.mark.parity

ALL = checks.forward_checks()
# The families added in 0.2.0 keep the default CI run within its time budget by
# running some extras only with `-m slow`: two of their four float32 quantized-KV
# variants (8-bit from token 12, 4-bit from the start) and the token-loop check
# beyond the long prompt at float32 and q4. The forward logits of every check run
# by default.
CORE = ("llama", "qwen3", "minicpm", "gemma4_text", "gemma4")


def _slow_if(extra: bool, check):
    return pytest.param(check, id=check.name, marks=[pytest.mark.slow] if extra else [])


def _forward_extra(c) -> bool:
    return c.family not in CORE and (c.kv_bits, c.quantized_kv_start) in ((8, 12), (4, 0))


def _loop_extra(c) -> bool:
    return c.family not in CORE and (c.kv_bits or c.prompt != "long" or c.dtype not in ("float32", "q4"))


def _explain(cmp):
    bad = cmp.first_mismatch()
    return (f"{cmp.name}: first mismatch at step {bad.step if bad else None}, "
            f"max|diff| {cmp.max_abs_diff:.3g}, tokens ours {cmp.tokens_ours[:8]} "
            f"ref {cmp.tokens_ref[:8]}")


@pytest.mark.parametrize("check", [_slow_if(_forward_extra(c), c) for c in ALL])
def test_forward_logits_bit_exact(check):
    cmp = checks.run_forward_check(check)
    assert len(cmp.steps) == checks.DECODE_STEPS + 2  # prefill + last prompt token + 32 steps
    assert cmp.equal, _explain(cmp)


GEN = [c for c in ALL if c.prompt == "long" or c.dtype in ("float32", "q4")]


@pytest.mark.parametrize("check", [_slow_if(_loop_extra(c), c) for c in GEN])
def test_token_loop_matches_generate_step(check):
    got, expected = checks.run_generate_check(check)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for k, ((_, a), (_, b)) in enumerate(zip(got, expected)):
        assert mx.array_equal(a, b).item(), f"logprobs differ at step {k}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kv_quantization_is_exercised(family):
    """A quantized-KV check passing would be vacuous if nothing got quantized:
    the caches must be quantized after the run and the logits must move."""
    group = 64 if family == "llama" else 32
    q = checks.ForwardCheck(family, "float32", "long", 4, group, 0)
    f = checks.ForwardCheck(family, "float32", "long")
    path = str(ensure_fixture(family))
    ours = load_model(path)[0]
    from engine.kv.quant import make_policy
    policy = make_policy(ours, kv_bits=4, kv_group_size=group)
    caches = ours.make_cache()
    prompt = mx.array(checks.prompt_ids(40))[None]
    quant_logits = ours(prompt, cache=caches)
    policy.apply(caches)
    assert all(c.bits == 4 for c in caches)
    step_q = ours(prompt[:, -1:], cache=caches)
    caches_f = ours.make_cache()
    ours(prompt, cache=caches_f)
    step_f = ours(prompt[:, -1:], cache=caches_f)
    assert not mx.array_equal(step_q, step_f).item()
    assert checks.run_forward_check(q).equal and checks.run_forward_check(f).equal


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MOE])
def test_negative_control_one_ulp(family):
    """Moving one weight tensor by one ulp (every element to its next float32)
    must make the parity check fail, with a tiny but nonzero diff.

    Finding: one ulp on a *single element* is not reliably visible: on these
    models it is absorbed by float32 rounding of the sums it enters (see
    docs/parity.md), so the control perturbs a whole tensor."""
    path = str(ensure_fixture(family))
    model = load_model(path)[0]
    mlp = model.layers[0].mlp
    arr = np.array(mlp.down_proj.weight)
    mlp.down_proj.weight = mx.array(np.nextafter(arr, np.float32(np.inf), dtype=np.float32))
    cmp = checks.run_forward_check(checks.ForwardCheck(family, "float32", "short"), ours_model=model)
    assert not cmp.equal
    assert 0 < cmp.max_abs_diff < 1e-3


def test_sharded_fixture_has_index():
    path = ensure_fixture("llama", "float32", shards=2)
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) == 2
