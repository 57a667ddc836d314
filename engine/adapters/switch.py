"""LoRA on mixture-of-experts switch layers (training; one adapter per layer).

Each expert gets its own low-rank pair: ``lora_a`` [experts, r, in] and
``lora_b`` [experts, out, r], applied to the rows routed to that expert with
the same gather matmuls as the base layer:

    y = base(x, idx) + (scale * gather(gather(dropout(x), A[idx]), B[idx])).astype(x.dtype)

Names and initialisation follow mlx-lm's ``LoRASwitchLinear``: with the same
``mx.random.seed`` the A matrices are identical (two global-key draws per
target: the throw-away weight of the switch layer mlx-lm builds first, then A),
and B starts at zero. Mounting such adapters at inference time (a second
adapter on top, scales, unmounting) is only implemented for dense projections
(`engine.adapters.lora.LoRALinear`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from engine.models.switch import QuantizedSwitchLinear, SwitchLinear

SWITCH_TYPES = (SwitchLinear, QuantizedSwitchLinear)


class LoRASwitchLinear(nn.Module):
    def __init__(self, base: nn.Module, rank: int = 8, scale: float = 20.0, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, SWITCH_TYPES):
            raise TypeError(f"LoRASwitchLinear wraps a switch layer, not {type(base).__name__}")
        experts, out_dims, in_dims = base.num_experts, base.output_dims, base.input_dims
        # 1) the weight of the switch layer mlx-lm's constructor builds and discards
        bound = math.sqrt(1 / in_dims)
        mx.random.uniform(low=-bound, high=bound, shape=(experts, out_dims, in_dims))
        self.linear = base
        self.dropout = nn.Dropout(p=dropout)
        self.scale = float(scale)
        # 2) A itself
        bound = 1 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(experts, rank, in_dims))
        self.lora_b = mx.zeros((experts, out_dims, rank))

    @property
    def num_experts(self):
        return self.linear.num_experts

    def __call__(self, x, indices, sorted_indices=False):
        y = self.linear(x, indices, sorted_indices=sorted_indices)
        z = mx.gather_mm(self.dropout(x), self.lora_a.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        z = mx.gather_mm(z, self.lora_b.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        return y + (self.scale * z).astype(x.dtype)
