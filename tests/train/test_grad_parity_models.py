"""L1 LoRA loss and gradients vs mlx-lm for the families added in 0.2.0
(qwen2, gemma3_text, gemma3, gemma4_unified, qwen3_moe, Gemma 4 MoE).

Same method as test_grad_parity: the same fixture, the same LoRA init on both
sides (same seed through each side's own LoRA code), the same random B, the
same batch; loss and every adapter gradient compared with `mx.array_equal`.
Every family uses mlx-lm's default targets (every Linear in every block; for
the MoE families also the experts' switch layers, one adapter pair per expert).
The MoE families are also checked with the adapters limited to the attention
projections, the dense MLP (beside the experts in Gemma 4, the dense layers of
Qwen3-MoE) and the router.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model as ref_load_model

from engine.loader import load_model
from engine.adapters.lora import apply_lora
from parity.fixtures.models import MOE, ensure_fixture
from tests.train.helpers import LORA, flat, inject_b, not_equal, random_batch
from train.loss import sft_loss

pytestmark = pytest.mark.parity

NEW = ["qwen2", "gemma3_text", "gemma3", "gemma4_unified", "qwen3_moe", "gemma4_moe"]
ATTN = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
DENSE_MLP = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
SHARED_KEYS = {"qwen3_moe": ATTN + DENSE_MLP + ["mlp.gate"],
               "gemma4_moe": ATTN + DENSE_MLP + ["router.proj"]}
# MoE families: bf16 activations over 4-bit experts stand in for bf16 weights on the CPU.
CASES = [(f, d, None) for f in NEW
         for d in ("float32", "q4") + (() if f in MOE else ("bfloat16",))]
CASES += [(f, d, "shared") for f in MOE for d in ("float32", "q4")]


def _pair(family, dtype, keys=None):
    p = ensure_fixture(family, dtype)
    ref, ours = ref_load_model(p)[0], load_model(p)[0]
    ref.freeze()
    mx.random.seed(11)
    linear_to_lora_layers(ref, -1, dict(LORA, keys=keys) if keys else dict(LORA))
    mx.random.seed(11)
    apply_lora(ours, **LORA, keys=keys)
    inject_b(ref, ours, seed=2)
    return ref, ours


@pytest.mark.parametrize("family,dtype,targets", CASES,
                         ids=[f"{f}-{d}" + (f"-{t}" if t else "") for f, d, t in CASES])
def test_loss_and_gradients_bit_exact(family, dtype, targets):
    ref, ours = _pair(family, dtype, SHARED_KEYS[family] if targets else None)
    batch, lengths = random_batch()
    (l_ref, n_ref), g_ref = nn.value_and_grad(ref, default_loss)(ref, batch, lengths)
    (l_our, n_our), g_our = nn.value_and_grad(ours, sft_loss)(ours, batch, lengths)
    assert int(n_ref) == int(n_our) == (30 - 5 + 1) + (41 - 1)
    assert mx.array_equal(l_ref, l_our).item(), (l_ref.item(), l_our.item())
    g_ref, g_our = flat(g_ref), flat(g_our)
    assert len(g_ref) >= 16
    bad = not_equal(g_ref, g_our)
    assert not bad, f"{len(bad)}/{len(g_ref)} gradients differ, e.g. {bad[:3]}"
    assert all(mx.any(g != 0).item() for g in g_our.values())
    if family in MOE:   # the router's adapter is trained through the expert weights
        assert any(k.endswith(("mlp.gate.lora_a", "router.proj.lora_a")) for k in g_our)
        experts = [k for k in g_our if ".switch_" in k]
        assert bool(experts) == (targets is None)   # per-expert adapters with default targets
        if experts:
            assert g_our[experts[0]].ndim == 3
