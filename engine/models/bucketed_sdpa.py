"""Multi-token attention on CUDA in shapes that recur: queries and keys padded to buckets.

MLX 0.32's CUDA attention sends a query of more than one token to cuDNN, whose plan cache is
keyed by the exact shapes (`build_sdpa_cache_key` in mlx/backend/cuda/
scaled_dot_product_attention.cpp): a cached agent turn's prefill chunk, a speculation round's
verify forward and a draft model's catch-up each come with a new query or key length, and
each new shape builds a plan: ~38 ms on an H100, against 0.33 ms for the attention itself
(reports/sdpa_plan/0.5.4/h100). Here, on CUDA, such a call runs over padded shapes: the query
padded to `bucket(T, 16)` rows, the keys and values to `bucket(L, 256)` columns (zeros), with
an additive mask in the query's dtype that keeps the real columns exactly as the unpadded
call's mask does (causal, or the given boolean mask) and none of the padding; the padded
query rows are dropped. A bucket's plan then serves every call whose lengths fall in it (at
most 8 buckets an octave). The mask is additive because MLX turns a boolean mask into an
additive one of the full [B, H, T, L] shape at every call; an additive [.., T, L] mask is read
as a broadcast view. It is built once per forward (every layer's call shares it), and only
while it stays under MAX_MASK_BYTES (64 MiB: a 2048-token chunk over 16K keys): past that the
chunk's own work dwarfs a plan's build, and the mask's memory would grow with the context.

On an H100 the padded call's output equals the exact call's bit for bit (every probed shape:
a 400-token chunk over 17-20K keys, a 5-token verify over 300-360; the padding adds exact
zeros) at a fraction of a plan's cost: L1 is unchanged. Elsewhere (the CPU, Metal) attention
is left as it is: no plans there.
"""

from __future__ import annotations

import threading
from typing import Optional, Union

import mlx.core as mx

MAX_MASK_BYTES = 64 << 20      # the padded additive mask's size at most
_CUDA: Optional[bool] = None
_LAST = threading.local()       # the last mask built: (key, the mask object it came from, mask)


def on_cuda() -> bool:
    """Whether the default device is a GPU that is not Metal (MLX's CUDA backend)."""
    global _CUDA
    if _CUDA is None:
        _CUDA = not mx.metal.is_available()
    return _CUDA and mx.default_device().type == mx.gpu


def bucket(n: int, floor: int) -> int:
    """n rounded up to an eighth of the power of two at or above it (at least `floor`): at
    most 8 buckets an octave, the padding under a quarter of n."""
    if n <= floor:
        return floor
    step = max(floor, (1 << (n - 1).bit_length()) // 8)
    return -(-n // step) * step


def takes(q: mx.array, k: mx.array, mask) -> bool:
    """Whether attention of queries q [B, H, T, D] over keys k [B, Hkv, L, D] with this mask
    runs `sdpa`: on CUDA, T > 1, the mask None, "causal" or boolean, and the padded mask at
    most MAX_MASK_BYTES (a long prompt's big chunks: their own work dwarfs a plan's build)."""
    if q.shape[2] < 2 or not on_cuda():
        return False
    if not (mask is None or isinstance(mask, str) or mask.dtype == mx.bool_):
        return False
    rows = 1 if mask is None or isinstance(mask, str) else max(1, mask.size // (
        mask.shape[-1] * mask.shape[-2]))
    size = rows * bucket(q.shape[2], 16) * bucket(k.shape[2], 256) * q.dtype.size
    return size <= MAX_MASK_BYTES


def padded_mask(mask, T: int, L: int, Tb: int, Lb: int, dtype) -> mx.array:
    """The additive mask [.., Tb, Lb] (0 kept, -inf not) of a call with T queries over L keys
    padded to Tb and Lb: the real block as `mask` (None: all kept; "causal": bottom-right),
    the padded columns not kept, the padded rows as the last real row."""
    if mask is None:
        keep = mx.ones((T, L), dtype=mx.bool_)
    elif isinstance(mask, str):
        keep = mx.arange(L)[None] <= mx.arange(L - T, L)[:, None]
    else:
        keep = mx.broadcast_to(mask, mask.shape[:-2] + (T, L))
    lead = keep.shape[:-2]
    if Lb > L:
        keep = mx.concatenate([keep, mx.zeros(lead + (T, Lb - L), dtype=mx.bool_)], axis=-1)
    if Tb > T:
        keep = mx.concatenate([keep, mx.broadcast_to(keep[..., -1:, :], lead + (Tb - T, Lb))],
                              axis=-2)
    while keep.ndim < 4:
        keep = keep[None]
    return mx.where(keep, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float,
         mask: Optional[Union[str, mx.array]]) -> mx.array:
    """`mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)` over padded
    shapes (`takes` says where)."""
    B, H, T, D = q.shape
    L = k.shape[2]
    Tb, Lb = bucket(T, 16), bucket(L, 256)
    key = (mask if isinstance(mask, str) or mask is None else id(mask), T, L, q.dtype)
    last = getattr(_LAST, "v", None)
    if last is not None and last[0] == key and (isinstance(mask, str) or last[1] is mask):
        bias = last[2]
    else:
        bias = padded_mask(mask, T, L, Tb, Lb, q.dtype)
        _LAST.v = (key, mask, bias)
    if Lb > L:
        pad = mx.zeros((B, k.shape[1], Lb - L, D), dtype=k.dtype)
        k = mx.concatenate([k, pad], axis=2)
        v = mx.concatenate([v, pad.astype(v.dtype)], axis=2)
    if Tb > T:
        q = mx.concatenate([q, mx.zeros((B, H, Tb - T, D), dtype=q.dtype)], axis=2)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias)[:, :, :T]
