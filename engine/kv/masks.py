"""Attention masks (shared by the KV caches and the models, which import both)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


def causal_mask(
    n: int,
    offset: int = 0,
    window: Optional[int] = None,
    left_padding: Optional[mx.array] = None,
    right_padding: Optional[mx.array] = None,
) -> mx.array:
    """Boolean [n, offset+n] mask: query i (at offset+i) sees key j when j <= offset+i,
    and, with a window W, when j > offset+i-W. Padding masks broadcast to [B,1,n,k]."""
    cols = mx.arange(offset + n)
    rows = mx.arange(offset, offset + n) if offset else cols
    rows = rows[:, None]
    cols = cols[None]
    mask = rows >= cols
    if window is not None:
        mask = mask & (rows < cols + window)
    if right_padding is not None:
        mask = mask & (cols < mx.expand_dims((offset + n) - right_padding, (1, 2, 3)))
    if left_padding is not None:
        mask = mask & (mx.expand_dims(left_padding, (1, 2, 3)) <= cols)
    return mask
