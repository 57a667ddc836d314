"""Attention as MLX's own composed ops, for speculation's short multi-token forwards.

`mx.fast.scaled_dot_product_attention` on CUDA (MLX 0.32) sends a query of more than one
token to cuDNN, whose plan is keyed by the exact K/V length: every verify forward of a
speculating request (K + 1 query tokens over a cache one round longer than the last) and
every catch-up of a draft model's cache builds a new plan, ~50 ms on an H100 — measured,
speculation served at 0.14× the same server without it (reports/spec_bench/0.5.3/). On the CPU
MLX never takes a fused kernel: it runs its fallback, a chain of ops (scale, matmul, mask,
precise softmax, matmul). `sdpa` is that chain written out with the same ops in the same
order, so on the CPU it gives the same bits as `mx.fast.scaled_dot_product_attention`
(tests/engine/test_composed_sdpa.py), and on CUDA it runs as ordinary matmuls with no plan
to build. `speculating()` turns it on for the forwards inside it whose queries have 2..MAX_QUERY
tokens (engine.step's verify and draft forwards); outside, attention is unchanged.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional, Union

import mlx.core as mx

_STATE = threading.local()
MAX_QUERY = 32      # query tokens a speculation forward takes it for (longer: left to MLX)


def takes(q: mx.array) -> bool:
    """Whether attention of queries q [B, H, L, D] runs `sdpa`: inside `speculating()` on
    this thread, with 1 < L <= MAX_QUERY."""
    return getattr(_STATE, "on", False) and 1 < q.shape[2] <= MAX_QUERY


@contextmanager
def speculating():
    """Within: speculation's short multi-token forwards run `sdpa` (the module docstring)."""
    before = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float,
         mask: Optional[Union[str, mx.array]]) -> mx.array:
    """softmax(scale * q k^T (masked)) v over [B, H, L, D] queries and [B, H_kv, S, D] keys and
    values (H a multiple of H_kv), `mask` None, "causal" (bottom-right aligned) or an array
    broadcastable to [B, H, L, S] (bool: keep where true; else added to the scores) — MLX's
    fallback of `mx.fast.scaled_dot_product_attention`, op for op."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v of one dtype, not {q.dtype}, {k.dtype}, {v.dtype}")
    dt = q.dtype
    B, n_q, L, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    rep = n_q // n_kv
    if isinstance(mask, mx.array):
        if mask.dtype != mx.bool_:
            mask = mask.astype(dt)
        mask = mx.broadcast_to(mask, (B, n_q, L, S))
    q = mx.multiply(mx.array(scale, dtype=dt), q)
    if rep > 1:
        q = mx.reshape(q, (B, n_kv, rep, L, D))
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = mx.matmul(q, mx.swapaxes(k, -1, -2))
    if mask is not None:
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"mask must be 'causal', an array or None, not {mask!r}")
            mask = mx.greater_equal(mx.arange(S - L, S)[:, None], mx.arange(0, S)[None])
        elif rep > 1:
            mask = mx.reshape(mask, (B, n_kv, rep, L, S))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = mx.add(scores, mask)
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.matmul(scores, v)
    if rep > 1:
        out = mx.reshape(out, (B, n_q, L, v.shape[-1]))
    return out
