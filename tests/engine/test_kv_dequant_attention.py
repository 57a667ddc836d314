"""Gate for the L3 dequantize-then-SDPA attention over quantized KV
(engine/kv/dequant_attention.py), measured against the L1 quantized path.

Measured on the CPU fixtures (one 48-token prompt, 33 teacher-forced steps):
float32 - bit-identical to the L1 path for kv8 and kv4 (llama, qwen3, gemma4_text,
gemma4); bfloat16 - not identical (L1 rounds the scores to bf16 inside
quantized_matmul), and its KL to the float-KV run is 0.30-1.03x the L1 path's.
CPU only: on MLX 0.32.4's CUDA backend the L1 path itself has no kernel (which is why the
L3 path exists), so there the comparison cannot run."""

import mlx.core as mx
import pytest

from engine.kv.dequant_attention import dequantized_kv_attention, enabled
from engine.kv.quant import make_policy
from engine.loader import load_model
from parity.fixtures.models import ensure_fixture
from parity.kv_quality import _run, default_group, prompts


def _runs(family, dtype, bits):
    m = load_model(ensure_fixture(family, dtype))[0]
    p = prompts()[0]
    seq = p + list(range(40, 72))
    g = default_group(m)

    def pol():
        return make_policy(m, quantized_kv_start=0, kv_bits=bits, kv_group_size=g)
    ref = _run(m, seq, len(p), make_policy(m))
    l1 = _run(m, seq, len(p), pol())
    with dequantized_kv_attention():
        assert enabled()
        l3 = _run(m, seq, len(p), pol())
    assert not enabled()
    return ref, l1, l3


def _kl(ref, q):
    return (mx.exp(ref) * (ref - q)).sum(-1).mean().item()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma4_text"])
def test_float32_equals_the_l1_quantized_path(family, bits):
    _, l1, l3 = _runs(family, "float32", bits)
    assert mx.array_equal(l1, l3).item()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma4_text"])
def test_bfloat16_quality_no_worse_than_l1(family, bits):
    ref, l1, l3 = _runs(family, "bfloat16", bits)
    assert not mx.array_equal(l1, l3).item()      # it is an L3 path: say so
    assert _kl(ref, l3) <= 1.5 * _kl(ref, l1), (_kl(ref, l3), _kl(ref, l1))
