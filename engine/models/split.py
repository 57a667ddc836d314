"""How a block splits for token-chunked training (used by train/segmented.py).

A block that supports it returns a :class:`TokenSplit` from `token_split()`:
the per-token parts before and after attention, so that a trainer can run them
a few thousand tokens at a time while only attention sees the whole sequence.
The parts must compose to the block's `__call__` op for op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class TokenSplit:
    """pre(x_rows, offset) -> (q, k, v) [B, heads, rows, head_dim] (just (q,) when
    `shared`: the layer attends over its donor's K/V); attention is causal with
    `scale` (and a sliding `window`, or None); post(x_rows, o_rows, extra_rows) ->
    the block's output rows, o_rows being attention's output as [B, rows,
    heads * head_dim] and extra_rows the block's per-layer-input rows (or None).
    `is_pre(name)`: whether the trainable parameter `name` (relative to the
    block) is used by `pre` (else by `post`)."""
    pre: Callable
    post: Callable
    scale: float
    window: Optional[int] = None
    shared: bool = False

    @staticmethod
    def is_pre(name: str) -> bool:
        return name.startswith("input_layernorm.") or (
            name.startswith("self_attn.") and not name.startswith("self_attn.o_proj."))


@dataclass(frozen=True)
class HalfSplit:
    """attn(x, mask) -> h: the block up to and including the attention residual;
    mlp(h) -> out: the rest (a per-token function)."""
    attn: Callable
    mlp: Callable
