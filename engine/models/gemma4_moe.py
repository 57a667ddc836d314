"""Gemma 4's mixture-of-experts block (26B-A4B layout, `enable_moe_block`).

In a MoE layer the dense GeGLU MLP and the experts run side by side on the
same residual: `post_ff_1(mlp(pre_ff(h))) + post_ff_2(experts(pre_ff_2(h)))`,
then the usual `post_feedforward_layernorm`. The router reads the un-normed
residual: RMSNorm scaled by `scale * hidden^-1/2`, a projection to expert
logits, top-k, a softmax over the k logits, times a learned per-expert scale.
HF checkpoints fuse the experts' gate and up projections
(`experts.gate_up_proj` [E, 2I, D]) and name the down projection
`experts.down_proj`; `split_experts` maps them to `experts.switch_glu.*`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .base import gelu_gate
from .switch import SwitchGLU


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.eps = top_k, eps
        self.proj = nn.Linear(dim, num_experts, bias=False)
        self.scale = mx.ones((dim,))
        self.per_expert_scale = mx.ones((num_experts,))
        self._root = dim ** -0.5

    def __call__(self, x):
        x = mx.fast.rms_norm(x, self.scale * self._root, self.eps)
        logits = self.proj(x)
        ids = mx.argpartition(logits, kth=-self.top_k, axis=-1)
        ids = mx.stop_gradient(ids[..., -self.top_k:])
        weights = mx.softmax(mx.take_along_axis(logits, ids, axis=-1), axis=-1)
        return ids, weights * self.per_expert_scale[ids]


class Experts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.switch_glu = SwitchGLU(dim, hidden, num_experts, act=gelu_gate)

    def __call__(self, x, ids, weights):
        return (mx.expand_dims(weights, -1) * self.switch_glu(x, ids)).sum(-2)


def add_moe(layer: nn.Module, a) -> None:
    """Give a decoder layer its router, experts and the three extra norms."""
    layer.router = Router(a.hidden_size, a.num_experts, a.top_k_experts, a.rms_norm_eps)
    layer.experts = Experts(a.hidden_size, a.moe_intermediate_size, a.num_experts)
    for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                 "pre_feedforward_layernorm_2"):
        setattr(layer, name, nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps))


def feed_forward(layer: nn.Module, h):
    """The MoE layer's feed-forward output, before `post_feedforward_layernorm`."""
    dense = layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(h)))
    ids, weights = layer.router(h)
    sparse = layer.experts(layer.pre_feedforward_layernorm_2(h), ids, weights)
    return dense + layer.post_feedforward_layernorm_2(sparse)


def split_experts(key: str, value: mx.array) -> dict:
    """HF expert tensors -> our names ({} when `key` is not an expert tensor)."""
    if key.endswith(".experts.gate_up_proj"):
        base = key.removesuffix(".gate_up_proj")
        gate, up = (mx.contiguous(t) for t in mx.split(value, 2, axis=-2))
        return {f"{base}.switch_glu.gate_proj.weight": gate,
                f"{base}.switch_glu.up_proj.weight": up}
    if key.endswith(".experts.down_proj"):
        return {f"{key.removesuffix('.down_proj')}.switch_glu.down_proj.weight": value}
    return {}


def quant_predicate(path: str, module) -> object:
    """How mlx-lm's converter quantizes this family: routers at 8 bits."""
    return {"group_size": 64, "bits": 8} if path.endswith("router.proj") else True
