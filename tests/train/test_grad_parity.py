"""L1: loss and every LoRA gradient vs mlx-lm, bit for bit, for every family.

Same fixture weights, the same LoRA init (same seed through each side's own
LoRA code), the same random B injected into both (with B = 0 every dA would be
zero), the same batch. Our side: `train.loss.sft_loss` under
`nn.value_and_grad` on our model; mlx-lm's side: `tuner.trainer.default_loss`
under `nn.value_and_grad` on mlx-lm's model.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model as ref_load_model

from engine.loader import load_model
from engine.adapters.lora import apply_lora
from parity.fixtures.models import ensure_fixture
from tests.train.helpers import FAMILIES, LORA, flat, inject_b, not_equal, random_batch
from train.loss import sft_loss

pytestmark = pytest.mark.parity


def _pair(family, dtype):
    p = ensure_fixture(family, dtype)
    ref, ours = ref_load_model(p)[0], load_model(p)[0]
    ref.freeze()
    mx.random.seed(11)
    linear_to_lora_layers(ref, -1, dict(LORA))
    mx.random.seed(11)
    apply_lora(ours, **LORA)
    inject_b(ref, ours, seed=2)
    return ref, ours


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_bit_exact(family, dtype):
    ref, ours = _pair(family, dtype)
    batch, lengths = random_batch()
    (l_ref, n_ref), g_ref = nn.value_and_grad(ref, default_loss)(ref, batch, lengths)
    (l_our, n_our), g_our = nn.value_and_grad(ours, sft_loss)(ours, batch, lengths)
    assert int(n_ref) == int(n_our) == (30 - 5 + 1) + (41 - 1)  # one pad target in row 0
    assert mx.array_equal(l_ref, l_our).item(), (l_ref.item(), l_our.item())
    g_ref, g_our = flat(g_ref), flat(g_our)
    assert len(g_ref) >= 28
    bad = not_equal(g_ref, g_our)
    assert not bad, f"{len(bad)}/{len(g_ref)} gradients differ, e.g. {bad[:3]}"
    # not vacuous: both A and B gradients are non-zero
    assert all(mx.any(g != 0).item() for g in g_our.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_loss_equals_default_loss(family):
    ref, ours = _pair(family, "float32")
    batch, lengths = random_batch(seed=4)
    a, na = default_loss(ref, batch, lengths)
    b, nb = sft_loss(ours, batch, lengths)
    assert mx.array_equal(a, b).item() and int(na) == int(nb)


@pytest.mark.parametrize("head", ["gather", "chunked"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_response_only_heads_equal_full_logits(family, dtype, head):
    """The heads that never build [B, T, vocab] logits: loss and gradients are
    bit-exact with the masked full-logits loss (CPU: the head matmul is
    row-independent and the CE is scattered back and reduced the same way)."""
    _, ours = _pair(family, dtype)
    batch, lengths = random_batch(seed=5)
    (l0, n0), g0 = nn.value_and_grad(ours, sft_loss)(ours, batch, lengths)
    fn = lambda m, b, l: sft_loss(m, b, l, head=head, chunk_size=8)  # noqa: E731
    (l1, n1), g1 = nn.value_and_grad(ours, fn)(ours, batch, lengths)
    assert mx.array_equal(l0, l1).item() and int(n0) == int(n1)
    assert not not_equal(flat(g0), flat(g1))
