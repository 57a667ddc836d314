"""Moves along the token axis shared by the batched caches (`engine.kv.batch_cache`,
`engine.kv.batch_quant`): on arrays [B, heads, T, x], or part by part on quantized
(packed, scales, biases) triples (`each`)."""

from __future__ import annotations

from typing import List

import mlx.core as mx


def roll_rows(x: mx.array, shifts: mx.array, axis: int = 2) -> mx.array:
    """Roll each row b of x (batch axis 0) right by shifts[b] along `axis` (a gather)."""
    n = x.shape[axis]
    pos = mx.arange(n).reshape((n,) + (1,) * (x.ndim - 1 - axis))
    sh = shifts.reshape((-1,) + (1,) * (x.ndim - 1))
    return mx.take_along_axis(x, (pos - sh) % n, axis=axis)


def ints(v) -> mx.array:
    return mx.array(list(v), dtype=mx.int32)


def each(fn, *xs):
    """fn on arrays, or part by part on quantized (packed, scales, biases) triples (a tuple)."""
    return tuple(fn(*p) for p in zip(*xs)) if isinstance(xs[0], (tuple, list)) else fn(*xs)


def part(x) -> mx.array:       # (an array, or a quantized triple's packed part)
    return x[0] if isinstance(x, (tuple, list)) else x


def every_row(keep: List[int], rows: int) -> bool:   # (then no gather: no copy of the KV)
    return len(keep) == rows and all(i == j for i, j in enumerate(keep))


def pad_time(k: mx.array, left: int, right: int) -> mx.array:
    """k [B, H, T, D] with `left` zero columns before and `right` after (cut where negative)."""
    if right < 0:
        k = k[..., :right, :]
        right = 0
    if left or right:
        k = mx.pad(k, [(0, 0), (0, 0), (left, right), (0, 0)])
    return k
