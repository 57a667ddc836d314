"""Qwen3-MoE (`model_type: qwen3_moe`, e.g. Qwen3-30B-A3B): Qwen3 attention
with a sparse mixture-of-experts MLP.

Layer i is sparse when it is not in `mlp_only_layers` and
`(i + 1) % decoder_sparse_step == 0`; other layers keep a dense SwiGLU MLP.
The router (`mlp.gate`) takes a precise softmax over all experts, keeps the
top `num_experts_per_tok`, optionally renormalises them (`norm_topk_prob`),
and the experts run through `switch.SwitchGLU` (gather matmuls).
HF checkpoints store one tensor per expert (`mlp.experts.E.{gate,up,down}_proj`);
`sanitize` stacks them into `mlp.switch_mlp.*` as [experts, out, in].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import mlx.core as mx
import mlx.nn as nn

from . import qwen3
from .base import GatedMLP
from .switch import SwitchGLU

PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Args(qwen3.Args):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self):
        super().__post_init__()
        # The reference builds plain RoPE from rope_theta and ignores rope_scaling.
        self.rope_scaling = None

    def is_sparse(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


def route(logits: mx.array, k: int, renormalise: bool):
    """(top-k expert ids, their weights) from router logits [..., experts]."""
    probs = mx.softmax(logits, axis=-1, precise=True)
    ids = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])
    weights = mx.take_along_axis(probs, ids, axis=-1)
    if renormalise:
        weights = weights / mx.sum(weights, axis=-1, keepdims=True)
    return ids, weights


class SparseMoE(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.top_k, self.renormalise = a.num_experts_per_tok, a.norm_topk_prob
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(a.hidden_size, a.moe_intermediate_size, a.num_experts)

    def __call__(self, x):
        ids, weights = route(self.gate(x), self.top_k, self.renormalise)
        y = self.switch_mlp(x, ids)
        return (y * weights[..., None]).sum(axis=-2).astype(y.dtype)


class Model(qwen3.Model):
    def __init__(self, args: Args):
        super().__init__(args)
        for i, layer in enumerate(self.model.layers):
            layer.mlp = (SparseMoE(args) if args.is_sparse(i)
                         else GatedMLP(args.hidden_size, args.intermediate_size))

    def sanitize(self, weights: dict) -> dict:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            prefix = f"model.layers.{i}.mlp"
            if f"{prefix}.experts.0.up_proj.weight" not in weights:
                continue
            for name in PROJ:
                parts = [weights.pop(f"{prefix}.experts.{e}.{name}.weight")
                         for e in range(self.args.num_experts)]
                weights[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(parts)
        return weights

    def quant_predicate(self, path: str, module) -> object:
        """How mlx-lm's converter quantizes this family: routers at 8 bits."""
        return {"group_size": 64, "bits": 8} if path.endswith("mlp.gate") else True
