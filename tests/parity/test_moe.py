"""Mixture-of-experts specifics (qwen3_moe, Gemma 4 MoE): the routing negative
control, the sorted-by-expert path, quantized experts, and the CPU bfloat16 limit.

The grid itself (logits at prefill and 32 decode steps, greedy tokens, batches,
quantized KV) runs for these families in test_forward / test_generate / test_batch.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.loader import load_model
from engine.models.switch import SORT_THRESHOLD, QuantizedSwitchLinear, SwitchGLU
from parity import checks
from parity.fixtures.models import MOE, ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity


def _switch(model, family):
    """(owner module, attribute name) of the first layer's expert block."""
    layer = model.layers[0]
    return (layer.mlp, "switch_mlp") if family == "qwen3_moe" else (layer.experts, "switch_glu")


class Rerouted(nn.Module):
    """Sends the first token's first expert slot to an expert it did not pick."""

    def __init__(self, inner: SwitchGLU, num_experts: int):
        super().__init__()
        self.inner, self.num_experts, self.calls = inner, num_experts, 0

    def __call__(self, x, indices):
        self.calls += 1
        first = indices.reshape(-1, indices.shape[-1])[0].tolist()
        other = next(e for e in range(self.num_experts) if e not in first)
        flat = indices.reshape(-1, indices.shape[-1])
        flat = mx.concatenate([mx.array([[other] + first[1:]], dtype=flat.dtype), flat[1:]])
        return self.inner(x, flat.reshape(indices.shape))


@pytest.mark.parametrize("family", MOE)
def test_negative_control_reroute_one_token(family):
    """Routing one token of the prompt to another expert must break parity;
    the same model with its router untouched must pass (the control is fair)."""
    model = load_model(str(ensure_fixture(family)))[0]
    check = checks.ForwardCheck(family, "float32", "short")
    assert checks.run_forward_check(check, ours_model=model).equal
    owner, name = _switch(model, family)
    inner = getattr(owner, name)
    setattr(owner, name, Rerouted(inner, inner.gate_proj.num_experts))
    try:
        cmp = checks.run_forward_check(check, ours_model=model)
        assert getattr(owner, name).calls > 0
    finally:
        setattr(owner, name, inner)
    assert not cmp.equal
    assert cmp.first_mismatch().step == -1   # already at the prefill


@pytest.mark.parametrize("family", MOE)
def test_long_prompt_takes_the_sorted_path(family):
    """The long prompt sends >= SORT_THRESHOLD (token, expert) pairs through the
    experts (the sorted gather path); the short one fewer (the unsorted path)."""
    model = load_model(str(ensure_fixture(family)))[0]
    owner, name = _switch(model, family)
    inner, seen = getattr(owner, name), []

    class Spy(nn.Module):
        def __call__(self, x, indices):
            seen.append(indices.size)
            return inner(x, indices)

    setattr(owner, name, Spy())
    try:
        for n in checks.PROMPT_LENS.values():
            model(mx.array(checks.prompt_ids(n))[None])
    finally:
        setattr(owner, name, inner)
    short, long_ = seen
    assert short < SORT_THRESHOLD <= long_


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("dtype", ["q4", "q8"])
def test_quantized_experts_and_8bit_router(family, dtype):
    model = load_model(str(ensure_fixture(family, dtype)))[0]
    owner, name = _switch(model, family)
    glu = getattr(owner, name)
    bits = 4 if dtype == "q4" else 8
    for proj in (glu.gate_proj, glu.up_proj, glu.down_proj):
        assert isinstance(proj, QuantizedSwitchLinear) and proj.bits == bits
    router = model.layers[0].mlp.gate if family == "qwen3_moe" else model.layers[0].router.proj
    assert isinstance(router, nn.QuantizedLinear) and router.bits == 8


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a statement about the CPU backend")
@pytest.mark.parametrize("family", MOE)
def test_bfloat16_experts_do_not_run_on_this_cpu(family):
    """Why the MoE bfloat16 fixtures are left out of the CPU grid: mlx's CPU
    gather_mm is float32-only, for mlx-lm and for us alike (checked on a GPU instead)."""
    path = str(ensure_fixture(family, "bfloat16"))
    prompt = mx.array(checks.prompt_ids(5))[None]
    for model in (oracle.load_model(path), load_model(path)[0]):
        with pytest.raises(RuntimeError, match="GatherMM"):
            mx.eval(model(prompt))


@pytest.mark.parametrize("family", MOE)
def test_mlx_lm_convert_q4_output_loads_bit_exact(family, tmp_path):
    """A checkpoint quantized by mlx-lm's own converter (4-bit, routers at 8 bits)
    loads in our engine and gives mlx-lm's logits (prefill + 32 decode steps)."""
    import json

    from mlx_lm import convert

    from parity.compare import run_schedule

    out = tmp_path / "q4"
    convert(str(ensure_fixture(family)), mlx_path=str(out), quantize=True, q_bits=4,
            q_group_size=64, dtype="bfloat16")
    overrides = {k: v for k, v in json.loads((out / "config.json").read_text())["quantization"].items()
                 if isinstance(v, dict)}
    assert overrides and all(v["bits"] == 8 for v in overrides.values())
    ours, ref = load_model(str(out))[0], oracle.load_model(str(out))
    cmp = run_schedule(family, ours, ours.make_cache(), lambda c: None, ref, oracle.make_cache(ref),
                       lambda c: None, checks.prompt_ids(40), checks.DECODE_STEPS)
    assert cmp.equal, cmp.first_mismatch()
