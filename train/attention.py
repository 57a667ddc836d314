"""Causal attention computed in query blocks, forward and backward.

MLX's fused attention backward (`mx.fast.scaled_dot_product_attention` under
`mx.vjp`; cuDNN on CUDA) runs the whole [T_q, T_kv] problem as one op. On the
H200 it fails with an out-of-memory error at 131,072 tokens (1B Llama shape,
bf16) although the forward and the memory curve up to 122,880 tokens are fine:
a limit of that one op, not of the training step (reports/peak_memory/0.2.0/).

Here the queries are cut into blocks of `block` rows. Block i (rows s..e) only
attends to keys k0..e (k0 = 0, or e - window for sliding layers), so its output
is `sdpa(q[s:e], k[k0:e], v[k0:e])` with the causal mask aligned bottom-right -
the same rows the whole-sequence op computes. The backward runs the fused vjp
of each block on its own (the fused kernel recomputes that block's softmax
statistics, its logsumexp, from its forward and keeps them for its backward):
dq rows come out per block, and dk / dv are the sums of every block's
contributions, accumulated in float32. No single op sees more than
`block` x T scores, and the extra memory is one block's workspace plus the
float32 dk / dv accumulators.

What actually limits the fused vjp on CUDA is not the scores but the sequence
lengths times the heads (FUSED_LIMIT_BYTES below): a call over T_q queries and
T_kv keys fails once (T_q + T_kv) x query heads x head_dim x 4 bytes reaches
2^31. Query blocks shrink T_q only; so each block's call is also cut into
groups of KV heads (with their query heads) small enough to stay under the
limit. Heads are independent: that cut changes no arithmetic, and it moves the
longest trainable context from ~2^29 / (heads x head_dim) tokens to ~2^29 /
(heads per KV head x head_dim) - 8x further with 8 KV heads.

Exactness: the output rows and dq are computed by the same kernels over the
same keys, dk / dv are re-associated sums over query blocks (a tolerance; see
tests/train/test_attention.py for what it measures on the CPU). That is why the
trainer uses this path only beyond a length threshold (`attn_block`, see
train/segmented.py), keeping the short-context paths bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx


@dataclass(frozen=True)
class Blocking:
    """How to run one layer's attention: `block` query rows at a time
    (0: the whole sequence in one op); `window`: sliding-window size or None."""
    block: int = 0
    window: Optional[int] = None


def spans(T: int, block: int) -> list[tuple[int, int]]:
    """Query blocks [s, e) covering 0..T; all but the first are `block` rows, so
    that every block but possibly the first is a multiple of `block` (the fused
    CUDA vjp wants query lengths that are multiples of 128)."""
    if block <= 0 or block >= T:
        return [(0, T)]
    first = T % block or block
    out = [(0, first)]
    s = first
    while s < T:
        out.append((s, s + block))
        s += block
    return out


def _block_mask(s: int, e: int, k0: int, window: Optional[int]):
    """The mask of query rows s..e over keys k0..e: "causal" when that is exact
    (no window and k0 == 0), else a boolean [e - s, e - k0] array."""
    if window is None and k0 == 0:
        return "causal"
    rows = mx.arange(s, e)[:, None]
    cols = mx.arange(k0, e)[None]
    m = rows >= cols
    if window is not None:
        m = m & (rows < cols + window)
    return m


def _key_start(s: int, window: Optional[int]) -> int:
    return 0 if window is None else max(0, s - window + 1)


def _whole_mask(T: int, window: Optional[int]):
    return _block_mask(0, T, 0, window) if (window is not None and T > window) else "causal"


# Measured on the H200 (MLX 0.32.4, reports/attention_limit/0.2.0/): the fused
# attention vjp fails with cudaMallocAsync "out of memory" (with >100 GB free) exactly
# when (T_q + T_kv) * query_heads * head_dim * 4 bytes reaches 2^31 - consistent with a
# 32-bit byte count of float32 accumulators overflowing - and runs below it.
FUSED_LIMIT_BYTES = 2 ** 31


def head_groups(n_q: int, n_kv: int, head_dim: int, rows: int, keys: int,
                limit: Optional[int] = None) -> list[tuple[int, int, int, int]]:
    """(q_lo, q_hi, kv_lo, kv_hi) head ranges such that one fused call over `rows`
    queries and `keys` keys stays below `limit`: the most KV heads per call (a
    divisor of n_kv, each with its n_q / n_kv query heads) that fit, at least one.
    Heads are independent, so splitting them changes no arithmetic."""
    limit = FUSED_LIMIT_BYTES if limit is None else limit
    rep = n_q // n_kv
    hk = next((h for h in range(n_kv, 0, -1)
               if n_kv % h == 0 and (rows + keys) * h * rep * head_dim * 4 < limit), 1)
    return [(g * rep, (g + hk) * rep, g, g + hk) for g in range(0, n_kv, hk)]


def _groups(q, k, s, e, k0):
    return head_groups(q.shape[1], k.shape[1], q.shape[3], e - s, e - k0)


def blocked_attention(q, k, v, scale: float, blocking: Blocking):
    """Causal (optionally sliding-window) attention of q [B, H, T, D] over k, v
    [B, Hkv, T, D], one query block (and, where needed, one group of heads) at a
    time; no autograd (forward only)."""
    T = q.shape[2]
    parts = []
    for s, e in spans(T, blocking.block):
        k0 = _key_start(s, blocking.window)
        mask = _block_mask(s, e, k0, blocking.window)
        heads = []
        for a, b, c, d in _groups(q, k, s, e, k0):
            o = mx.fast.scaled_dot_product_attention(
                q[:, a:b, s:e], k[:, c:d, k0:e], v[:, c:d, k0:e], scale=scale, mask=mask)
            mx.eval(o)
            heads.append(o)
        parts.append(mx.concatenate(heads, axis=1) if len(heads) > 1 else heads[0])
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]


def blocked_attention_vjp(q, k, v, scale: float, blocking: Blocking, do):
    """(dq, dk, dv) of `blocked_attention` for the output cotangent do
    [B, H, T, D]: the fused vjp of each query block (per head group) against its
    keys, dk / dv accumulated in float32 over query blocks and cast to k's / v's
    dtype at the end."""
    T = q.shape[2]
    sp = spans(T, blocking.block)
    dk = mx.zeros(k.shape, dtype=mx.float32)
    dv = mx.zeros(v.shape, dtype=mx.float32)
    dqs = []
    for s, e in sp:
        k0 = _key_start(s, blocking.window)
        mask = _block_mask(s, e, k0, blocking.window) if len(sp) > 1 else _whole_mask(
            T, blocking.window)

        def f(q_, k_, v_, mask=mask):
            return [mx.fast.scaled_dot_product_attention(q_, k_, v_, scale=scale, mask=mask)]

        dq_h = []
        for a, b, c, d in _groups(q, k, s, e, k0):
            _, (dq_i, dk_i, dv_i) = mx.vjp(
                f, [q[:, a:b, s:e], k[:, c:d, k0:e], v[:, c:d, k0:e]], [do[:, a:b, s:e]])
            if len(sp) == 1:  # one block: no sum over blocks, keep the vjp's own dtype
                dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
                dk[:, c:d] = dk_i
                dv[:, c:d] = dv_i
            else:
                dk[:, c:d, k0:e] += dk_i.astype(mx.float32)
                dv[:, c:d, k0:e] += dv_i.astype(mx.float32)
            mx.eval(dq_i, dk, dv)
            dq_h.append(dq_i)
        dqs.append(mx.concatenate(dq_h, axis=1) if len(dq_h) > 1 else dq_h[0])
    dq = mx.concatenate(dqs, axis=2) if len(dqs) > 1 else dqs[0]
    del dqs
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)
