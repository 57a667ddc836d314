"""Matrix-vector products for the decode step, with the neighbouring work fused in.

`linear(module, x, ...)` computes `module(x)` for a few rows of x (decode: one token
per row) and optionally folds in what surrounds a projection in a decoder layer:

- `norm=(weight, eps)`: x is the residual stream and is RMS-normalised on the fly
  (the layer norm before q/k/v, before gate/up, and the final norm before the head);
- `residual=h`: returns `h + module(x)` (the residual add after o_proj and down_proj);
- `silu_split=I`: the module is a merged gate/up projection (gate rows first, then up);
  returns `silu(gate) * up`, shape [.., I].

On an NVIDIA GPU (`use_kernel=True`) this is one CUDA kernel (`mx.fast.cuda_kernel`,
compiled at run time; sources in engine.fast.gemv_cuda). By default (`MLXP_GEMV_KERNEL=warp`)
one warp computes one output row (a gate row and its up row together for the SiLU
epilogue), 8 warps a block: its lanes stream 16-byte vectors of the row, several
iterations' loads in flight before their products, and reduce with shuffles; for a batch
each weight vector read serves every input row. `MLXP_GEMV_KERNEL=split` is the other
layout (4 warps per row splitting K, weights staged through shared memory with cp.async).
The
RMSNorm is folded in as a scale: the lanes accumulate sum(W * (norm_w * h)) and sum(h^2)
in the same pass and the row sum is multiplied by rsqrt(mean(h^2) + eps) at the end, so
the normalised input is never rounded or stored (the L1 path rounds it to the model's
dtype; this changes rounding, which is what the L3 gate measures).
Otherwise the same computation runs with stock MLX operations, in the order the
model's own modules use (so on the CPU the result is the L1 result bit for bit).

Float weights only (bf16, fp16, fp32), no bias; `supports(module)` says whether a
module can take the kernel.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import gemv_cuda as C
from . import qgemv as Q

MAX_ROWS = 8          # batch rows per kernel call (more: stock matmul)
# MLXP_GEMV_TUNE=1: per projection shape, measure once on the device whether the kernel or
# the stock ops run faster (`tune_linear`, `tune_qkv_rope`) and use the faster. Off by
# default: timed alone, back to back, the stock ops of the small projections measure
# faster, but inside the step each of them is one more launch (on the H200 the tuned step
# did not come out faster), so by default every projection takes the kernel.
TUNE = os.environ.get("MLXP_GEMV_TUNE", "0") == "1"
_CHOICE: dict = {}
THREADS = 128       # the split layout: 4 warps a block (its WARPS)
KERNELS = ("warp", "split")
# the layout (see the module docstring) and, for "warp", warps per block and loads in flight
KERNEL = os.environ.get("MLXP_GEMV_KERNEL", "warp")
WARPS_PB = int(os.environ.get("MLXP_GEMV_WARPS", "8"))
UNROLL = int(os.environ.get("MLXP_GEMV_UNROLL", "4"))
KSPLIT = int(os.environ.get("MLXP_GEMV_KSPLIT", "0"))      # 0: by shape (`ksplit_for`)
MIN_WARPS = 6144    # warps a projection should keep busy (H200: 132 SMs x ~48 resident)
if KERNEL not in KERNELS:
    raise ValueError(f"MLXP_GEMV_KERNEL must be one of {KERNELS}, not {KERNEL!r}")


def _get_kernel(rope: bool = False):
    from . import kernels as K            # (built there, so that K.empty_kernels covers it)
    main = C.WARP_MAIN if KERNEL == "warp" else C.SPLIT_MAIN
    if rope:
        return K.cuda_kernel(f"mlxp_gemv_rope_{KERNEL}", ["W", "x", "norm_w", "inv_freq", "pos"],
                             ["q", "k", "v"], main + C.ROPE_EPILOGUE, C.GEMV_HEADER)
    return K.cuda_kernel(f"mlxp_gemv_{KERNEL}", ["W", "x", "norm_w", "residual"], ["out"],
                         main + C.GEMV_EPILOGUE, C.GEMV_HEADER)


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


def launch(units: int, rows_per_unit: int, K: int = 0, itemsize: int = 2) -> tuple:
    """(extra template parameters, grid, threadgroup) for `units` output units (rows, or
    rotation pairs) of K inputs: `rows_per_unit` of them per block in the split layout."""
    if KERNEL == "warp":
        ks = ksplit_for(units, K, itemsize)
        t = WARPS_PB * 32
        per = WARPS_PB // ks
        return ([("R", 1), ("WARPS_PB", WARPS_PB), ("UNROLL", UNROLL), ("KSPLIT", ks)],
                (-(-units // per) * t, 1, 1), (t, 1, 1))
    return [("R", rows_per_unit)], (-(-units // rows_per_unit) * THREADS, 1, 1), (THREADS, 1, 1)


def is_float(module) -> bool:
    """A plain float Linear (or an Embedding used as the output head) without bias."""
    if type(module) not in (nn.Linear, nn.Embedding) or "bias" in module:
        return False
    w = module.weight
    return w.dtype in (mx.bfloat16, mx.float16, mx.float32) and w.shape[1] % (16 // w.itemsize) == 0


def supports(module) -> bool:
    """A module the kernels take: a float one (`is_float`), or an affine 4/8-bit quantized
    one (`engine.fast.qgemv.supports`)."""
    return is_float(module) or Q.supports(module)


def rows_per_block(n_out: int, batch: int, silu: bool) -> int:
    """Output rows per block (4 warps splitting K): one row (or gate/up pair) for a single
    input row, 4 rows for the large output head (fewer, longer blocks); for a batch, up to
    4 (2 with SiLU) so each input vector read serves several weight rows (accumulators
    <= 32 per lane)."""
    per = 2 if silu else 1
    if batch == 1:
        return 4 if (not silu and n_out > 16384) else 1
    return max(1, min(4 // per, 32 // (per * batch)))


def _silu_gate(gate, up):
    return nn.silu(gate) * up


def _standin(module, x, norm, residual, silu_split, gate_fn):
    if norm is not None:
        x = mx.fast.rms_norm(x, norm[0], norm[1])
    y = module.as_linear(x) if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)) else module(x)
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
    if (not use_kernel or rows > MAX_ROWS or not supports(module)
            or not _CHOICE.get(_key(module, rows, norm, residual, silu_split), True)):
        return _standin(module, x, norm, residual, silu_split, gate_fn)
    W = module.weight
    N = W.shape[0]
    n_out = silu_split if silu_split is not None else N
    if silu_split is not None and N != 2 * silu_split:
        raise ValueError("silu_split needs a merged gate/up weight of 2 * I rows")
    k_in = W.shape[1] if is_float(module) else Q.in_features(module)
    if k_in != K:
        raise ValueError(f"input has {K} features, the weight {k_in}")
    if not is_float(module):
        return Q.linear(module, x, n_out, norm=norm, residual=residual, silu_split=silu_split)
    dt = W.dtype
    epi = 2 if silu_split is not None else (1 if residual is not None else 0)
    extra, grid, tg = launch(n_out, rows_per_block(n_out, rows, silu_split is not None), K, W.itemsize)
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
             n_heads: int, n_kv: int, head_dim: int, shift: int = 0):
    """The merged q/k/v projection of the RMS-normalised x, with RoPE at position pos[0]
    (pos of shape [1]) or pos[b] for row b (pos of shape [B]) (+ shift) applied to q and k,
    as one kernel (CUDA only; the caller keeps the stock path elsewhere): returns
    q [B, H, 1, D], k and v [B, Hkv, 1, D]."""
    K = x.shape[-1]
    rows = x.size // K
    W = module.weight
    N = (n_heads + 2 * n_kv) * head_dim
    if W.shape != (N, K) or head_dim % 2 or rows > MAX_ROWS:
        raise ValueError("qkv_rope needs a merged q/k/v weight, an even head_dim and <= 8 rows")
    dt = W.dtype
    extra, grid, tg = launch(N // 2, 1, K, W.itemsize)
    if KERNEL == "split":
        extra = [("R", 2)]                   # (one block per pair: its two rows)
    q, k, v = _get_kernel(rope=True)(
        inputs=[W, x.astype(dt).reshape(rows, K), norm[0].astype(dt), inv_freq, pos.astype(mx.int32)],
        template=[("T", dt), ("K", K), ("NOUT", N), ("B", rows), *extra, ("NORM", 1), ("EPI", 0),
                  ("ROPE_D", head_dim), ("NQ", n_heads), ("NKV", n_kv), ("SHIFT", shift),
                  ("PER_ROW", int(pos.size > 1)),
                  ("EPS_NUM", int(round(norm[1] * 1e12)))],
        grid=grid, threadgroup=tg,
        output_shapes=[(rows, n_heads, 1, head_dim), (rows, n_kv, 1, head_dim), (rows, n_kv, 1, head_dim)],
        output_dtypes=[dt] * 3)
    return q, k, v


# --- choosing between the kernel and the stock ops, by measurement -------------------

def _key(module, rows, norm, residual, silu_split, kind="linear"):
    w = module.weight
    return (kind, tuple(w.shape), str(w.dtype), rows, norm is not None, residual is not None, silu_split)


def stream_us(fn, n: int = 20, reps: int = 3) -> float:
    """Microseconds per call of fn() with n calls evaluated back to back (as in a decode
    step, where the launches overlap), median of reps."""
    mx.eval([fn() for _ in range(2)])
    ts = []
    for _ in range(reps):
        outs = [fn() for _ in range(n)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e6 * sorted(ts)[reps // 2] / n


def uses_kernel(module, rows: int, *, norm: bool = False, residual: bool = False,
                silu_split: Optional[int] = None) -> bool:
    """Whether `linear` takes the kernel for this projection (True until tuned otherwise)."""
    return supports(module) and rows <= MAX_ROWS and _CHOICE.get(
        _key(module, rows, norm or None, residual or None, silu_split), True)


def tune_linear(module, rows: int, *, norm: bool = False, residual: bool = False,
                silu_split: Optional[int] = None, gate_fn: Optional[Callable] = None) -> dict:
    """Time the kernel and the stock ops for this projection on random inputs (the real
    weights) and remember the faster; returns {"kernel_us", "stock_us", "use"}."""
    if not supports(module) or rows > MAX_ROWS:
        return {"use": "stock"}
    dt = module.weight.dtype if is_float(module) else module.scales.dtype
    K = module.weight.shape[1] if is_float(module) else Q.in_features(module)
    n_out = silu_split or module.weight.shape[0]
    x = mx.random.normal((rows, 1, K)).astype(dt)
    nrm = (mx.ones((K,), dt), 1e-5) if norm else None
    res = mx.random.normal((rows, 1, n_out)).astype(dt) if residual else None
    key = _key(module, rows, nrm, res, silu_split)
    _CHOICE.pop(key, None)
    return _decide(key, lambda: linear(module, x, norm=nrm, residual=res, silu_split=silu_split,
                                       gate_fn=gate_fn, use_kernel=True),
                   lambda: _standin(module, x, nrm, res, silu_split, gate_fn))


def _decide(key, kernel_fn, stock_fn) -> dict:
    """Time both; a kernel that cannot run here (no CUDA device, a compile error) loses."""
    out = {}
    try:
        tk = stream_us(kernel_fn)
    except Exception as e:                      # noqa: BLE001  (any failure: use the stock ops)
        tk, out["kernel_error"] = float("inf"), f"{type(e).__name__}: {e}"[:200]
    ts = stream_us(stock_fn)
    _CHOICE[key] = tk <= ts
    out.update(kernel_us=round(tk, 2), stock_us=round(ts, 2), use="kernel" if tk <= ts else "stock")
    if os.environ.get("MLXP_GEMV_TUNE_LOG"):
        print(json.dumps({"gemv_tune": [str(k) for k in key], **out}), file=sys.stderr, flush=True)
    return out


def qkv_rope_preferred(module, rows: int) -> bool:
    return _CHOICE.get(_key(module, rows, None, None, None, kind="qkv_rope"), True)


def tune_qkv_rope(module, rows: int, inv_freq, n_heads: int, n_kv: int, head_dim: int, rope) -> dict:
    """qkv_rope (one kernel) against the q/k/v projection (as `linear` would run it)
    followed by the RoPE kernel; remembers the faster."""
    from . import kernels as K
    dt = module.weight.dtype
    Kd = module.weight.shape[1]
    x = mx.random.normal((rows, 1, Kd)).astype(dt)
    nrm = (mx.ones((Kd,), dt), 1e-5)
    pos = mx.array([7], dtype=mx.int32)
    key = _key(module, rows, None, None, None, kind="qkv_rope")
    return _decide(key, lambda: qkv_rope(module, x, nrm, inv_freq, pos, n_heads, n_kv, head_dim)[0],
                   lambda: K.rope_qkv(linear(module, x, norm=nrm, use_kernel=True), inv_freq, pos,
                                      n_heads, n_kv, head_dim, rope, True)[0])
