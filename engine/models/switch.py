"""Mixture-of-experts building blocks: per-expert weights stacked as
[experts, out, in] and applied with MLX's gather matmuls (`mx.gather_mm`,
`mx.gather_qmm`), never with a Python loop over experts.

`SwitchGLU(x, indices)` runs each token through its top-k experts' gated MLP
and returns [..., k, dim]; the caller weights and sums over k. With 64 or more
(token, expert) pairs the rows are first sorted by expert (`sorted_indices`
lets the kernel walk each expert's weights once) and unsorted afterwards.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .base import silu_gate

SORT_THRESHOLD = 64   # (token, expert) pairs from which rows are sorted by expert


def _sort_by_expert(x, indices):
    """x [..., 1, 1, D] and indices [..., k] -> rows ordered by expert id."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], mx.argsort(order)


class QuantizedSwitchLinear(nn.Module):
    """Stacked expert weights, affine-quantized per expert (mlx-lm's converter layout)."""

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *rest = mx.quantize(weight, group_size, bits, mode=mode)
        self.biases = rest[0] if rest else None
        self.freeze()

    @property
    def num_experts(self):
        return self.weight.shape[0]

    @property
    def input_dims(self):
        return self.scales.shape[2] * self.group_size

    @property
    def output_dims(self):
        return self.weight.shape[1]

    def __call__(self, x, indices, sorted_indices=False):
        return mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices,
            transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
            sorted_indices=sorted_indices)


class SwitchLinear(nn.Module):
    """Stacked expert weights [experts, out, in] (no bias: no supported family has one)."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int):
        super().__init__()
        bound = math.sqrt(1 / in_dims)
        self.weight = mx.random.uniform(-bound, bound, (num_experts, out_dims, in_dims))

    @property
    def num_experts(self):
        return self.weight.shape[0]

    @property
    def input_dims(self):
        return self.weight.shape[2]

    @property
    def output_dims(self):
        return self.weight.shape[1]

    def __call__(self, x, indices, sorted_indices=False):
        return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **kw):
        if kw.get("global_scale"):
            raise ValueError("per-expert global scales (nvfp4) are not supported")
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode)


class SwitchGLU(nn.Module):
    """Gated expert MLP: down(act(gate(x)) * up(x)) for each selected expert.

    `act(gate, up)` is a compiled gate function (SwiGLU by default)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, act=silu_gate):
        super().__init__()
        self.gate_proj = SwitchLinear(dim, hidden, num_experts)
        self.up_proj = SwitchLinear(dim, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dim, num_experts)
        self._act = act

    def __call__(self, x, indices):
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= SORT_THRESHOLD
        idx, inverse = indices, None
        if do_sort:
            x, idx, inverse = _sort_by_expert(x, indices)
        up = self.up_proj(x, idx, sorted_indices=do_sort)
        gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        out = self.down_proj(self._act(gate, up), idx, sorted_indices=do_sort)
        if do_sort:
            out = mx.unflatten(out[inverse], 0, indices.shape)
        return out.squeeze(-2)
