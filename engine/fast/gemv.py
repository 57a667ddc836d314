"""Matrix-vector products for the decode step, with the neighbouring work fused in.

`linear(module, x, ...)` computes `module(x)` for a few rows of x (decode: one token
per row) and optionally folds in what surrounds a projection in a decoder layer:

- `norm=(weight, eps)`: x is the residual stream and is RMS-normalised on the fly
  (the layer norm before q/k/v, before gate/up, and the final norm before the head);
- `residual=h`: returns `h + module(x)` (the residual add after o_proj and down_proj);
- `silu_split=I`: the module is a merged gate/up projection (gate rows first, then up);
  returns `silu(gate) * up`, shape [.., I].

On an NVIDIA GPU (`use_kernel=True`) this is one CUDA kernel (`mx.fast.cuda_kernel`,
compiled at run time; sources engine/fast/cuda/gemv*.cu): one to four warps compute one
output row (a gate row and its up row together for the SiLU epilogue), 8 warps a block: its
lanes stream 16-byte vectors of the row, several iterations' loads in flight before their
products, and reduce with shuffles; for a batch each weight vector read serves every input
row. The RMSNorm is folded in as a scale: the lanes accumulate sum(W * (norm_w * h)) and sum(h^2)
in the same pass and the row sum is multiplied by rsqrt(mean(h^2) + eps) at the end, so
the normalised input is never rounded or stored (the L1 path rounds it to the model's
dtype; this changes rounding, which is what the L3 gate measures).
Otherwise the same computation runs with stock MLX operations, in the order the
model's own modules use (so on the CPU the result is the L1 result bit for bit).

Float weights (bf16, fp16, fp32), no bias; affine 4-bit weights go to
`engine.fast.qmm` (the tensor-core kernel; the norm before it as MLX's `rms_norm`) for up to
`qmm.MAX_ROWS` rows. `supports(module)` says whether a module can take either kernel.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import qmm as Q
from .sources import source

MAX_ROWS = 8          # batch rows per kernel call (more: stock matmul)
# warps per block and loads in flight per lane (the fastest of experiments/gemv_sweep.py's layouts)
WARPS_PB = 8
UNROLL = 4
KSPLIT = 0          # warps per output row: 0, by shape (`ksplit_for`); gemv_sweep sets 1, 2 or 4
MIN_WARPS = 6144    # warps a projection should keep busy (H200: 132 SMs x ~48 resident)


def _get_kernel(rope: bool = False):
    from . import kernels as K            # (built there, so that K.empty_kernels covers it)
    if rope:
        return K.cuda_kernel("mlxp_gemv_rope_warp", ["W", "x", "norm_w", "inv_freq", "pos"], ["q", "k", "v"],
                             source("gemv_main.cu") + source("gemv_rope_epilogue.cu"), source("gemv.cuh"))
    return K.cuda_kernel("mlxp_gemv_warp", ["W", "x", "norm_w", "residual"], ["out"],
                         source("gemv_main.cu") + source("gemv_epilogue.cu"), source("gemv.cuh"))


def ksplit_for(units: int, K: int, itemsize: int) -> int:
    """Warps per output unit in the warp layout: 1, or 2 / 4 where the projection has too
    few rows to keep MIN_WARPS warps busy (each warp keeping >= 2 iterations of K)."""
    if KSPLIT:
        return KSPLIT
    its = -(-K // (32 * (16 // itemsize)))
    ks = 1
    while ks < 4 and units * ks < MIN_WARPS and its >= 4 * ks:
        ks *= 2
    return ks


def launch(units: int, K: int = 0, itemsize: int = 2) -> tuple:
    """(extra template parameters, grid, threadgroup) for `units` output units (rows, or
    rotation pairs) of K inputs."""
    ks = ksplit_for(units, K, itemsize)
    t = WARPS_PB * 32
    per = WARPS_PB // ks
    return ([("R", 1), ("WARPS_PB", WARPS_PB), ("UNROLL", UNROLL), ("KSPLIT", ks)],
            (-(-units // per) * t, 1, 1), (t, 1, 1))


def is_float(module) -> bool:
    """A plain float Linear (or an Embedding used as the output head) without bias."""
    if type(module) not in (nn.Linear, nn.Embedding) or "bias" in module:
        return False
    w = module.weight
    return w.dtype in (mx.bfloat16, mx.float16, mx.float32) and w.shape[1] % (16 // w.itemsize) == 0


def supports(module) -> bool:
    """A module a kernel takes: a float one (`is_float`) or a 4-bit one (`qmm.supports`)."""
    return is_float(module) or Q.supports(module)


def _silu_gate(gate, up):
    return nn.silu(gate) * up


def _standin(module, x, norm, residual, silu_split, gate_fn, fold: bool = False):
    """The module's own operations; `fold`: x [..., K] goes through it as one [rows, K] matmul
    (a quantized matmul over [B, 1, K] ran as B one-row products on CUDA, each reading every
    weight: an 8B 4-bit step of 64 rows took 213 ms on an H100, 28 ms folded:
    reports/fast_verify/0.6.0/)."""
    if norm is not None:
        x = mx.fast.rms_norm(x, norm[0], norm[1])
    lead = x.shape[:-1]
    if fold:
        x = x.reshape(-1, x.shape[-1])
    y = module.as_linear(x) if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)) else module(x)
    if fold:
        y = y.reshape(*lead, y.shape[-1])
    if silu_split is not None:
        g, u = mx.split(y, [silu_split], axis=-1)
        y = (gate_fn or _silu_gate)(g, u)
    if residual is not None:
        y = residual + y
    return y


def linear(module, x: mx.array, *, norm: Optional[Tuple[mx.array, float]] = None,
           residual: Optional[mx.array] = None, silu_split: Optional[int] = None,
           gate_fn: Optional[Callable] = None, use_kernel: bool = False) -> mx.array:
    """module(x) with an optional RMSNorm before it and a residual add or SiLU-gating after
    it (see the module docstring). x: [..., K] with at most MAX_ROWS rows. `gate_fn`
    is the model's own silu(gate) * up function, used by the stock-MLX path so that it
    computes exactly what the model computes (the kernel always applies SiLU)."""
    K = x.shape[-1]
    rows = x.size // K
    if use_kernel and rows <= Q.MAX_ROWS and Q.supports(module):
        if norm is not None:
            x = mx.fast.rms_norm(x, norm[0], norm[1])
        return Q.linear(module, x, residual=residual, silu_split=silu_split)
    if not use_kernel or rows > MAX_ROWS or not is_float(module):
        return _standin(module, x, norm, residual, silu_split, gate_fn,
                        fold=use_kernel and rows > 1 and x.ndim > 2 and not is_float(module))
    W = module.weight
    N = W.shape[0]
    n_out = silu_split if silu_split is not None else N
    if silu_split is not None and N != 2 * silu_split:
        raise ValueError("silu_split needs a merged gate/up weight of 2 * I rows")
    if W.shape[1] != K:
        raise ValueError(f"input has {K} features, the weight {W.shape[1]}")
    dt = W.dtype
    epi = 2 if silu_split is not None else (1 if residual is not None else 0)
    extra, grid, tg = launch(n_out, K, W.itemsize)
    dummy = mx.zeros((1,), dt)
    nw = norm[0].astype(dt) if norm is not None else dummy
    res = residual.astype(dt).reshape(rows, n_out) if residual is not None else dummy
    (out,) = _get_kernel()(
        inputs=[W, x.astype(dt).reshape(rows, K), nw, res],
        template=[("T", dt), ("K", K), ("NOUT", n_out), ("B", rows), *extra,
                  ("NORM", int(norm is not None)), ("EPI", epi), ("ROPE_D", 0),
                  ("EPS_NUM", int(round((norm[1] if norm is not None else 0.0) * 1e12)))],
        grid=grid, threadgroup=tg,
        output_shapes=[(rows, n_out)], output_dtypes=[dt])
    return out.reshape(*x.shape[:-1], n_out)


def qkv_rope(module, x: mx.array, norm: Tuple[mx.array, float], inv_freq: mx.array, pos: mx.array,
             n_heads: int, n_kv: int, head_dim: int):
    """The merged q/k/v projection of the RMS-normalised x, with RoPE at position pos[0]
    (pos of shape [1]) or pos[b] for row b (pos of shape [B]) applied to q and k (one position
    more inside `kernels.inject_fault("rope_pos_plus_one")`: engine.fast.kernels.cuda_kernel),
    as one kernel (CUDA only; the caller keeps the stock path elsewhere): returns
    q [B, H, 1, D], k and v [B, Hkv, 1, D]."""
    K = x.shape[-1]
    rows = x.size // K
    W = module.weight
    N = (n_heads + 2 * n_kv) * head_dim
    if W.shape != (N, K) or head_dim % 2 or rows > MAX_ROWS:
        raise ValueError("qkv_rope needs a merged q/k/v weight, an even head_dim and <= 8 rows")
    dt = W.dtype
    extra, grid, tg = launch(N // 2, K, W.itemsize)
    q, k, v = _get_kernel(rope=True)(
        inputs=[W, x.astype(dt).reshape(rows, K), norm[0].astype(dt), inv_freq, pos.astype(mx.int32)],
        template=[("T", dt), ("K", K), ("NOUT", N), ("B", rows), *extra, ("NORM", 1), ("EPI", 0),
                  ("ROPE_D", head_dim), ("NQ", n_heads), ("NKV", n_kv),
                  ("PER_ROW", int(pos.size > 1)),
                  ("EPS_NUM", int(round(norm[1] * 1e12)))],
        grid=grid, threadgroup=tg,
        output_shapes=[(rows, n_heads, 1, head_dim), (rows, n_kv, 1, head_dim), (rows, n_kv, 1, head_dim)],
        output_dtypes=[dt] * 3)
    return q, k, v
