"""Batch-invariant kernels: deterministic mode on CUDA (docs/deterministic.md).

On MLX's CUDA backend a row's logits depend on the batch it shares a forward with: the
matmuls pick their kernel (and its reduction split) by the number of rows, and attention
takes one kernel to decode (a query) and another to prefill (cuDNN, many queries), each
splitting the keys by the call's own lengths. Here, with `enable()` (the Engine does it for
`deterministic=True` on a GPU), the same math runs in shapes and orders that depend on the
row alone:

- **matmuls**: every projection, MLP matmul and output head runs on blocks of exactly
  `ROWS` rows (the rows padded with zeros), so one kernel with one reduction order serves a
  lone decode row, a batch of 32 and a 2048-token prefill chunk (`apply(model)`: the model's
  `Linear`, `QuantizedLinear` and tied-embedding heads). On CUDA a float weight takes every
  block in one `mx.gather_mm` call (`gathered`); a quantized one, and any on the CPU, a call
  per block (`blocked`);
- **attention**: `attention()` runs engine/fast/cuda/attn_rows.cu and attn_rows_combine.cu:
  a query's keys are read in chunks of `CH` counted from its row's first key, each chunk by
  8 warps in a fixed interleave, the chunks combined in order, so the result is the same for a
  query decoded alone, in a batch, at any column offset (left padding) or inside a prefill
  chunk of any size;
- RMSNorm, RoPE, the activations, the residual adds and the logits' softmax are per row
  already (MLX's kernels reduce a row by itself).

What it covers: full-attention dense models (`SUPPORTED`), float or 4/8-bit weights, float
KV. On the CPU deterministic mode needs none of this (MLX's CPU kernels are invariant
already: engine.deterministic), and `attention(..., use_kernel=False)` is the same math in
stock MLX (its masks from the same row ranges), which the CPU tests check against MLX's own
attention.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from engine.kv.batch_cache import BatchKVCache
from engine.kv.cache import KVCache
from engine.models.base import attention_overridden, set_attention_override
from engine.models.bucketed_sdpa import on_cuda

from .kernels import cuda_kernel
from .sources import source

ROWS = 64                 # a matmul's rows per call
CH = 256                  # an attention chunk's keys
PARTIAL_BYTES = 256 << 20  # the pass-1 partials of one call at most (longer queries: several calls)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "minicpm")
_LAST: dict = {}          # per kind, the last (key, value) built: a forward's layers share them


def enable(on: bool = True) -> None:
    """Route every model's attention through the batch-invariant kernel (process-wide: an
    Engine in deterministic mode on a GPU sets it; so would a second one)."""
    set_attention_override(_route if on else None)


def _route(q, k, v, scale, mask, cache):
    return attention(q, k, v, scale, mask, cache)


def enabled() -> bool:
    return attention_overridden()


def why_unsupported(model) -> Optional[str]:
    """Why this model cannot run the batch-invariant kernels (None: it can)."""
    kind = getattr(getattr(model, "args", None), "model_type", None) or getattr(model, "model_type", None)
    if kind not in SUPPORTED:
        return (f"--deterministic on a GPU is built for full-attention dense models "
                f"({', '.join(SUPPORTED)}), not {kind!r}: sliding windows, mixtures of experts "
                f"and vision towers have no batch-invariant kernels yet")
    return None


# --- matmuls ---------------------------------------------------------------------------

_CONST: dict = {}


def _const(key, make):
    """make(), made once per key (constants: scales, block indices)."""
    if key not in _CONST:
        _CONST[key] = make()
    return _CONST[key]


def _last(kind: str, key, make):
    """make(), or what it made last time for this kind when `key` is the same (`key` holds
    the arrays it depends on, compared by identity and kept, so none is freed and its id
    reused; other entries compared by value)."""
    hit = _LAST.get(kind)
    if hit is not None and len(hit[0]) == len(key) and all(
            a is b or (not isinstance(a, mx.array) and not isinstance(b, mx.array) and a == b)
            for a, b in zip(hit[0], key)):
        return hit[1]
    out = make()
    _LAST[kind] = (key, out)
    return out


def _rows(x: mx.array):
    """(n, pad, rows): x's n rows zero-padded by `pad` to a multiple of ROWS, [n + pad, K]
    (kept for the next call on the same x: q/k/v, gate/up)."""
    k = x.shape[-1]
    n = x.size // k
    pad = -n % ROWS
    rows = _last("rows", (x,), lambda: mx.pad(x.reshape(-1, k), ((0, pad), (0, 0))) if pad
                 else x.reshape(-1, k))
    return n, pad, rows


def blocked(fn, x: mx.array) -> mx.array:
    """fn (a row-wise matmul) over x's rows in blocks of exactly ROWS rows (`_rows`), a call
    per block."""
    n, pad, rows = _rows(x)
    if n + pad == ROWS:          # one block (every decode step up to ROWS rows)
        out = fn(rows)
    else:
        out = mx.concatenate([fn(rows[i:i + ROWS]) for i in range(0, n + pad, ROWS)])
    return (out[:n] if pad else out).reshape(*x.shape[:-1], out.shape[-1])


def gathered(w: mx.array, x: mx.array) -> mx.array:
    """x @ w.T (w [N, K], a float weight) with x's rows in blocks of exactly ROWS rows, every
    block in ONE call: `mx.gather_mm` over [blocks, ROWS, K] with each block's own index and the
    one weight. On CUDA that is MLX's own GEMM kernel, its tile chosen by the rows of a block
    (ROWS, always) and no split of K, so a row's sums run in one order whatever the number of
    blocks; and it skips cuBLASLt, whose algorithm MLX 0.32 looks up on the host at every call
    (tens of microseconds, ~113 times a 1B decode step). On the CPU it takes float32 only."""
    n, pad, rows = _rows(x)
    nb, k = (n + pad) // ROWS, x.shape[-1]
    lhs, rhs = _const(("blocks", nb), lambda: (mx.arange(nb, dtype=mx.uint32),
                                                mx.zeros((nb,), mx.uint32)))
    out = mx.gather_mm(rows.reshape(nb, ROWS, k), w.T[None], lhs, rhs).reshape(nb * ROWS, w.shape[0])
    return (out[:n] if pad else out).reshape(*x.shape[:-1], w.shape[0])


class _Linear(nn.Linear):
    def __call__(self, x):
        if not on_cuda():
            return blocked(super().__call__, x)
        out = gathered(self["weight"], x)
        return out + self["bias"] if "bias" in self else out


class _QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        return blocked(super().__call__, x)


class _Embedding(nn.Embedding):
    def as_linear(self, x):
        if not on_cuda():
            return blocked(super().as_linear, x)
        return gathered(self.weight, x)


class _QuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        return blocked(super().as_linear, x)


_BLOCKED = {nn.Linear: _Linear, nn.QuantizedLinear: _QuantizedLinear,
            nn.Embedding: _Embedding, nn.QuantizedEmbedding: _QuantizedEmbedding}


def apply(model) -> int:
    """Make every Linear / QuantizedLinear / embedding head of `model` run its matmuls on
    ROWS-row blocks (the module's class is swapped for a subclass: its parameters, their
    names and its other behaviour are unchanged). Returns how many modules were changed."""
    n = 0
    for _, module in model.named_modules():
        cls = _BLOCKED.get(type(module))
        if cls is not None:
            module.__class__ = cls
            n += 1
    return n


def applied(model) -> bool:
    """Whether `apply` has run on this model."""
    return any(type(m) in _BLOCKED.values() for _, m in model.named_modules())


# --- attention -------------------------------------------------------------------------

def _ranges(mask, B: int, T: int, L: int):
    """(lo [B], hi [B, T], mask [B, T, L] or None): row b's first key, query t's end (one past
    its last key), and the boolean mask the kernel reads inside [lo, hi)."""
    if mask is None or isinstance(mask, str):
        if isinstance(mask, str) and mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        lo = mx.zeros((B,), mx.int32)
        end = mx.arange(L - T + 1, L + 1, dtype=mx.int32) if mask == "causal" else mx.full((T,), L, mx.int32)
        return lo, mx.broadcast_to(end[None], (B, T)), None
    if mask.dtype != mx.bool_:
        raise ValueError("the batch-invariant attention takes a boolean or causal mask, not an additive one")
    if mask.ndim == 4:
        if mask.shape[1] != 1:
            raise ValueError("the batch-invariant attention takes one mask for every head")
        mask = mask[:, 0]
    m = mx.contiguous(mx.broadcast_to(mask.reshape((-1,) + mask.shape[-2:]), (B, T, L)))
    ints = m.astype(mx.int32)
    lo = mx.argmax(ints[:, -1], axis=-1).astype(mx.int32)
    hi = (L - mx.argmax(ints[:, :, ::-1], axis=-1)).astype(mx.int32)
    return lo, hi, m


def ranges(mask, B: int, T: int, L: int):
    """`_ranges`, kept for the last mask seen (a forward's layers share one mask)."""
    return _last("ranges", (mask, B, T, L), lambda: _ranges(mask, B, T, L))


def reference(q, k, v, scale: float, mask) -> mx.array:
    """The kernel's math in stock MLX: each query over keys [lo[b], hi[b, t]) where the mask
    (if any) is true (what `attention` computes, in MLX's own reduction order)."""
    B, _, T, _ = q.shape
    L = k.shape[2]
    lo, hi, m = _ranges(mask, B, T, L)
    cols = mx.arange(L)
    keep = (cols[None, None] >= lo[:, None, None]) & (cols[None, None] < hi[..., None])
    if m is not None:
        keep = keep & m
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=keep[:, None])


def buffers(cache, k: mx.array, v: mx.array):
    """The cache's whole K/V buffers when k, v are their first columns (the kernel then reads
    them in place; a sliced view would be copied every layer), else k, v."""
    if type(cache) not in (KVCache, BatchKVCache):
        return k, v
    kb, vb = cache.keys, cache.values
    if kb is None or kb.shape[:2] != k.shape[:2] or kb.shape[3] != k.shape[3] or kb.shape[2] < k.shape[2]:
        return k, v
    return kb, vb


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask, cache=None,
              use_kernel: bool = True) -> mx.array:
    """Attention of q [B, H, T, D] over k, v [B, Hkv, L, D] under `mask` (None, "causal" or
    boolean), every query computed by itself (module docstring). A block serves one query of
    a row when T is 1 (decoding) and 1024 // D queries of it otherwise (they share the key
    loads; each query's arithmetic is the same either way: reports/deterministic/JOURNAL.md)."""
    if not use_kernel:
        return reference(q, k, v, scale, mask)
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if D % 32 or D > 256 or H % Hkv:
        raise ValueError("the batch-invariant attention needs head_dim a multiple of 32 (at most 256) "
                         "and query heads a multiple of the KV heads")
    lo, hi, m = ranges(mask, B, T, L)
    keys, values = buffers(cache, k, v)
    cap = keys.shape[2]
    nc = max(1, -(-L // CH))
    qt = 1 if T == 1 else 1024 // D
    per_query = B * H * nc * (D + 2) * 4
    step = max(qt, PARTIAL_BYTES // per_query // qt * qt)
    sc = _const(("scale", scale), lambda: mx.array([scale], mx.float32))
    mk = m if m is not None else _const("nomask", lambda: mx.zeros((1,), mx.bool_))
    part = cuda_kernel("mlxp_attn_rows", ["q", "keys", "values", "lo_row", "hi_q", "mask", "scale", "dims"],
                       ["partial"], source("attn_rows.cu"))
    comb = cuda_kernel("mlxp_attn_rows_combine", ["partial", "dims"], ["out"], source("attn_rows_combine.cu"))
    tmpl = [("T", q.dtype), ("H", H), ("HKV", Hkv), ("D", D), ("QT", qt), ("CH", CH)]
    threads = (D + 31) // 32 * 32
    outs = []
    for t0 in range(0, T, step):
        tq = min(step, T - t0)
        shape = (tq, nc, cap, t0, T, L, int(m is not None))
        dims = _last(f"dims{t0}", shape, lambda: mx.array(shape, mx.int32))
        qs = q if tq == T else q[:, :, t0:t0 + tq]
        nt = -(-tq // qt)
        (partial,) = part(inputs=[qs, keys, values, lo, hi, mk, sc, dims], template=tmpl,
                          grid=(B * H * nt * nc * 256, 1, 1), threadgroup=(256, 1, 1),
                          output_shapes=[(B * H * tq * nc, D + 2)], output_dtypes=[mx.float32])
        (out,) = comb(inputs=[partial, dims], template=[("T", q.dtype), ("D", D)],
                      grid=(B * H * tq * threads, 1, 1), threadgroup=(threads, 1, 1),
                      output_shapes=[(B, H, tq, D)], output_dtypes=[q.dtype])
        outs.append(out)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
