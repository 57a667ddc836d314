"""Multi-token attention on CUDA in shapes that recur: queries and keys padded to buckets.

MLX 0.32's CUDA attention sends a query of more than one token to cuDNN, whose plan cache is
keyed by the exact shapes (`build_sdpa_cache_key` in mlx/backend/cuda/
scaled_dot_product_attention.cpp): a cached agent turn's prefill chunk, a speculation round's
verify forward and a draft model's catch-up each come with a new query or key length, and
each new shape builds a plan: ~38 ms on an H100, against 0.33 ms for the attention itself
(reports/sdpa_plan/0.5.4/h100). Here, on CUDA, such a call runs over padded shapes: the query
padded to `bucket(T, 16)` rows, the keys and values to `bucket(L, 256)` columns (zeros), with
a mask that keeps the real columns exactly as the unpadded call's mask does (causal, or the
given boolean mask) and none of the padding; the padded query rows are dropped. A bucket's
plan then serves every call whose lengths fall in it (at most 8 buckets an octave).

The mask handed over is the additive one MLX itself would make of that boolean mask (0 kept,
-inf not, in the query's dtype) at [1 or B, 1, Tb, Lb]: one mask for every head, not materialised
over them (on the H100 bit for bit the exact call's output in every probed call, 0.61 ms against
1.44 ms for the mask materialised at [B, H, Tb, Lb] and 67 ms for the exact call: a 400-token chunk
over 17-20K keys; reports/sdpa_plan/0.5.5/h100-bcast). It is built once per forward and shared by
every layer's call while it is at most KEEP_MASK_BYTES (a bigger one is built per call). Padded
shapes are used only while the padded scores [B, H, Tb, Lb] stay under MAX_MASK_BYTES of the
query's dtype (a long prompt's big chunks keep the exact call: their own work dwarfs a plan's
build). Elsewhere (the CPU, Metal) attention is left as it is.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional, Union

import mlx.core as mx

MAX_MASK_BYTES = 1 << 30       # the padded scores' size at most ([B, H, Tb, Lb] in q's dtype)
KEEP_MASK_BYTES = 64 << 20     # a mask this small is built once for all layers (else per call)
_CUDA: Optional[bool] = None
_LAST = threading.local()       # the last mask built: (key, the mask object it came from, mask)
_OFF = threading.local()        # on: `exact_shapes()`
_SEEN: set = set()              # the padded call shapes run so far (their cuDNN plans built)
_CALL: Optional[tuple] = None   # the last call's (B, H, Hkv, D, dtype, T, mask kind)


def on_cuda(device=None) -> bool:
    """Whether `device` (default: the default device) is a GPU that is not Metal (MLX's CUDA
    backend)."""
    global _CUDA
    if _CUDA is None:
        _CUDA = not mx.metal.is_available()
    return _CUDA and (device if device is not None else mx.default_device()).type == mx.gpu


def bucket(n: int, floor: int) -> int:
    """n rounded up to an eighth of the power of two at or above it (at least `floor`): at
    most 8 buckets an octave, the padding under a quarter of n."""
    if n <= floor:
        return floor
    step = max(floor, (1 << (n - 1).bit_length()) // 8)
    return -(-n // step) * step


@contextmanager
def exact_shapes():
    """Within (this thread): attention at the exact shapes, as MLX runs it (the trainer: a
    gradient's backward through padded shapes could take another kernel, and its sequence
    lengths do not change from step to step the way an agent's turns do)."""
    before = getattr(_OFF, "on", False)
    _OFF.on = True
    try:
        yield
    finally:
        _OFF.on = before


def takes(q: mx.array, k: mx.array, mask) -> bool:
    """Whether attention of queries q [B, H, T, D] over keys k [B, Hkv, L, D] with this mask
    runs `sdpa`: on CUDA, T > 1, the mask None, "causal" or boolean, and the padded scores
    [B, H, Tb, Lb] at most MAX_MASK_BYTES."""
    if q.shape[2] < 2 or not on_cuda() or getattr(_OFF, "on", False):
        return False
    if not (mask is None or isinstance(mask, str) or mask.dtype == mx.bool_):
        return False
    size = q.shape[0] * q.shape[1] * bucket(q.shape[2], 16) * bucket(k.shape[2], 256)
    size *= q.dtype.size
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
    global _CALL
    B, H, T, D = q.shape
    L = k.shape[2]
    Tb, Lb = bucket(T, 16), bucket(L, 256)
    kind = mask if isinstance(mask, str) or mask is None else ("array",) + mask.shape[:-2]
    _CALL = (B, H, k.shape[1], D, q.dtype, T, kind)
    _SEEN.add((B, H, k.shape[1], D, q.dtype, Tb, Lb, kind))
    key = (mask if isinstance(mask, str) or mask is None else id(mask), B, H, T, L, q.dtype)
    last = getattr(_LAST, "v", None)
    if last is not None and last[0] == key and (isinstance(mask, str) or last[1] is mask):
        bias = last[2]
    else:
        bias = padded_mask(mask, T, L, Tb, Lb, q.dtype)    # [1 or B, 1, Tb, Lb]: every head's
        if bias.shape[0] not in (1, B) or bias.shape[1] != 1:
            bias = mx.contiguous(mx.broadcast_to(bias, (B, H, Tb, Lb)))   # (a per-head mask)
        # kept for the next layers' calls only while small: it outlives the forward
        _LAST.v = (key, mask, bias) if bias.nbytes <= KEEP_MASK_BYTES else None
    if Lb > L:
        pad = mx.zeros((B, k.shape[1], Lb - L, D), dtype=k.dtype)
        k = mx.concatenate([k, pad], axis=2)
        v = mx.concatenate([v, pad.astype(v.dtype)], axis=2)
    if Tb > T:
        q = mx.concatenate([q, mx.zeros((B, H, Tb - T, D), dtype=q.dtype)], axis=2)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias)[:, :, :T]


def _warm(B: int, H: int, Hkv: int, D: int, dtype, kind, T: int, L: int) -> bool:
    """Run, on zeros, T queries over L keys in this call's shape (`kind`: its mask, as `sdpa`
    records it), unless that bucket pair has run already or `takes` would not pad it."""
    if (B, H, Hkv, D, dtype, bucket(T, 16), bucket(L, 256), kind) in _SEEN:
        return False
    # (q laid out as a model's: heads transposed out of [B, T, H, D])
    q, k = mx.zeros((B, T, H, D), dtype).transpose(0, 2, 1, 3), mx.zeros((B, Hkv, L, D), dtype)
    mask = kind
    if isinstance(kind, tuple):          # a boolean mask of the same leading shape, causal
        causal = mx.arange(L)[None] <= mx.arange(L - T, L)[:, None]
        mask = mx.broadcast_to(causal, kind[1:] + (T, L))
    if not takes(q, k, mask):
        return False
    mx.eval(sdpa(q, k, k, 1.0, mask))
    return True


def warm_next(length: int) -> bool:
    """Run once, on zeros, the call the next turn of a conversation that ended at `length`
    tokens would make: the last call's queries over `length` + that many keys. A turn whose
    keys cross into a new bucket otherwise builds its cuDNN plan on its first token (~70 ms on
    an H100, reports/prompt_cache_disk/0.5.5); the Engine calls this while idle
    (`Engine.idle`). Returns whether it ran (not: no call yet, the last one of several rows
    (a batch's shapes do not repeat turn after turn), that shape already run, or one `takes`
    would not pad)."""
    if _CALL is None or _CALL[0] != 1 or not on_cuda():
        return False
    B, H, Hkv, D, dtype, T, kind = _CALL
    return _warm(B, H, Hkv, D, dtype, kind, T, length + T)


def warm_turns(shapes, length: int, most: int = 1024) -> int:
    """Run once, on zeros, the calls the next turns of a conversation stored at `length`
    tokens would make: a query of up to `most` new tokens (one call a query bucket) over
    `length` + that many keys, for each (heads, KV heads, head dim, dtype) of `shapes`. A
    restarted server's first turn restores its prefix and prefills its new part over it: each
    new bucket pair built its cuDNN plan there (a 1B's ~400-token prefill after a restore took
    180-200 ms on an H100, ~30 ms on a running server). Returns how many calls ran (0 off
    CUDA, or where `takes` would not pad)."""
    if not on_cuda() or length < 1:
        return 0
    ran = 0
    for H, Hkv, D, dtype in shapes:
        T = 2
        while T <= most:
            Tb = bucket(T, 16)
            ran += _warm(1, H, Hkv, D, dtype, "causal", Tb, length + Tb)
            T = Tb + 1
    return ran
