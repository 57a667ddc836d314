"""Multi-token attention on CUDA in shapes that recur: queries and keys padded to buckets.

MLX 0.32's CUDA attention sends a query of more than one token to cuDNN, whose plan cache is
keyed by the exact shapes (`build_sdpa_cache_key`): a cached agent turn's prefill chunk, whose
query length and key length are new every turn, builds a plan every turn. Here the query is
padded to `bucket(T)` rows and the keys and values to `bucket(L)` columns (zeros), the mask
keeps the real columns as the unpadded call's mask does and none of the padding, and the
padded query rows are dropped: a bucket's plan serves every turn whose lengths fall in it.

EXPERIMENT (`MLXP_BUCKETED_SDPA=1`, CUDA only): measured against the exact call by
`experiments/sdpa_plan_probe.py` and `experiments/ttft_phases.py`; kept only if it wins and
equals the exact call bit for bit, else deleted (reports/l3/JOURNAL.md).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import mlx.core as mx


def enabled() -> bool:
    return os.environ.get("MLXP_BUCKETED_SDPA") == "1" and mx.default_device().type == mx.gpu


def bucket(n: int, floor: int) -> int:
    """n rounded up to an eighth of the power of two at or above it (at least `floor`): at
    most 8 buckets an octave, at most 1/8 of padding."""
    if n <= floor:
        return floor
    step = max(floor, (1 << (n - 1).bit_length()) // 8)
    return -(-n // step) * step


def takes(q: mx.array) -> bool:
    return q.shape[2] > 1 and enabled()


def _keep(mask, T: int, L: int) -> mx.array:
    """The mask as a boolean [.., T, L] (keep where true) of a call without padding."""
    if mask is None:
        return mx.ones((T, L), dtype=mx.bool_)
    if isinstance(mask, str):
        return mx.arange(L)[None] <= mx.arange(L - T, L)[:, None]
    if mask.dtype == mx.bool_:
        return mask
    return mask > -float("inf")        # (additive: kept where finite; values dropped below)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float,
         mask: Optional[Union[str, mx.array]]) -> mx.array:
    """`mx.fast.scaled_dot_product_attention(q, k, v, scale, mask)` over padded shapes."""
    if mask is not None and not isinstance(mask, str) and mask.dtype != mx.bool_:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, H, T, D = q.shape
    L = k.shape[2]
    Tb, Lb = bucket(T, 16), bucket(L, 256)
    keep = _keep(mask, T, L)
    keep = mx.broadcast_to(keep, keep.shape[:-2] + (T, L)) if keep.ndim >= 2 else keep
    lead = keep.shape[:-2]
    if Lb > L:
        keep = mx.concatenate([keep, mx.zeros(lead + (T, Lb - L), dtype=mx.bool_)], axis=-1)
        pad = mx.zeros((B, k.shape[1], Lb - L, D), dtype=k.dtype)
        k, v = mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad.astype(v.dtype)], axis=2)
    if Tb > T:
        keep = mx.concatenate([keep, mx.broadcast_to(keep[..., -1:, :], lead + (Tb - T, Lb))],
                              axis=-2)
        q = mx.concatenate([q, mx.zeros((B, H, Tb - T, D), dtype=q.dtype)], axis=2)
    while keep.ndim < 4:
        keep = keep[None]
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=keep)
    return out[:, :, :T]
