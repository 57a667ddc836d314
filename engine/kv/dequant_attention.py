"""L3 transform: attention over quantized K/V by dequantizing them first.

The L1 path (engine.models.base._quantized_attention) multiplies with
`mx.quantized_matmul` directly on the packed K/V, as mlx-lm does. MLX 0.32.4's
CUDA backend has no `quantized_matmul` kernel for the P.V product at general
cache lengths (and none for Q.K at group size 128), so neither engine can run a
quantized KV cache on an NVIDIA GPU. With this switch on, a quantized layer
dequantizes its K/V to the activation dtype and calls the fused SDPA instead:
the cache still stores (and is sized by) the quantized tensors, so the quality
of quantized KV can be measured there, but the per-step dequantized copy costs
memory traffic and the logits are not bit-exact with L1 (different rounding
order). Off by default; gated by tests/engine/test_kv_dequant_attention.py
(KL and top-1 agreement against the L1 quantized path).
"""

from __future__ import annotations

from contextlib import contextmanager

_enabled = False


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


@contextmanager
def dequantized_kv_attention(on: bool = True):
    old = _enabled
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(old)
