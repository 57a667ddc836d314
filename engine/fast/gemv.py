"""Matrix-vector products for the decode step, with the neighbouring work fused in.

`linear(module, x, ...)` computes `module(x)` for a few rows of x (decode: one token
per row) and optionally folds in what surrounds a projection in a decoder layer:

- `norm=(weight, eps)`: x is the residual stream and is RMS-normalised on the fly
  (the layer norm before q/k/v, before gate/up, and the final norm before the head);
- `residual=h`: returns `h + module(x)` (the residual add after o_proj and down_proj);
- `silu_split=I`: the module is a merged gate/up projection (gate rows first, then up);
  returns `silu(gate) * up`, shape [.., I].

On an NVIDIA GPU (`use_kernel=True`) this is one CUDA kernel (`mx.fast.cuda_kernel`,
compiled at run time): a block of 4 warps per output row (a gate row and its up row
together for the SiLU epilogue; a few rows per block for a batch, so an input vector
read serves several weight rows, and for the large output head); the warps split the
K axis, their lanes copy 16-byte vectors of the rows into shared memory with cp.async
(a chunk of up to 8 per lane in flight at once, the next chunk copied while the current
one is multiplied), reduce their sums with shuffles and then across the 4 warps in
shared memory, and the first warp applies the epilogue. The
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

from . import qgemv as Q

MAX_ROWS = 8          # batch rows per kernel call (more: stock matmul)
# MLXP_GEMV_TUNE=1: per projection shape, measure once on the device whether the kernel or
# the stock ops run faster (`tune_linear`, `tune_qkv_rope`) and use the faster. Off by
# default: timed alone, back to back, the stock ops of the small projections measure
# faster, but inside the step each of them is one more launch (on the H200 the tuned step
# did not come out faster), so by default every projection takes the kernel.
TUNE = os.environ.get("MLXP_GEMV_TUNE", "0") == "1"
_CHOICE: dict = {}
THREADS = 128       # 4 warps a block (the kernel's WARPS)

# The weight vectors go through shared memory with cp.async (sm_80+): all of a chunk's
# copies are in flight at once whatever the compiler's schedule (plain loads into
# registers get interleaved with the arithmetic, leaving ~2 loads in flight), and the
# next chunk is copied while the current one is multiplied.
GEMV_HEADER = r"""
__device__ __forceinline__ void mlxp_cp16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void mlxp_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void mlxp_cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
"""

GEMV_MAIN = r"""
  // a block of WARPS warps per R output rows (R gate rows and their R up rows for the
  // SiLU epilogue); the warps split K: warp w takes the 32*VEC-element slices
  // it = w, w + WARPS, ...; lane l owns the 16-byte vector at k = (it * 32 + l) * VEC.
  // A chunk (U slices of every row) is copied to shared memory in one go, the next
  // chunk while the current one is multiplied; the warps' sums meet in shared memory.
  constexpr int WARPS = 4;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int IT = (K + 32 * VEC - 1) / (32 * VEC);
  constexpr int ITW = (IT + WARPS - 1) / WARPS;
  constexpr int RL = EPI == 2 ? 2 * R : R;
  constexpr int U0 = 8 / RL > 0 ? 8 / RL : 1;
  constexpr int U = U0 < ITW ? U0 : ITW;
  constexpr int NCH = (ITW + U - 1) / U;
  constexpr int NB = NCH > 1 ? 2 : 1;
  __shared__ uint4 sw[WARPS][NB][RL * U][32];
  __shared__ float red[WARPS][RL * B + B];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // ROPE_D (the RoPE epilogue, R = 2): block j owns the pair of rows (i, i + D/2) of
  // head j / (D/2), i = j % (D/2); otherwise rows n0 .. n0 + R - 1
  const int n0 = ROPE_D ? (int)blockIdx.x : (int)blockIdx.x * R;
  if (n0 >= (ROPE_D ? NOUT / 2 : NOUT)) return;
  auto issue = [&](int c, int buf) {
#pragma unroll
    for (int r = 0; r < RL; ++r) {
      const int o = ROPE_D ? (n0 / (ROPE_D / 2)) * ROPE_D + n0 % (ROPE_D / 2) + r * (ROPE_D / 2)
                           : min(n0 + (r % R), NOUT - 1);   // (a row past the end: read, not written)
      const size_t row = (EPI == 2 && r >= R) ? (size_t)(NOUT + o) : (size_t)o;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int it = warp + WARPS * (c + u);
        int k = (it * 32 + lane) * VEC;
        if (it >= IT || k >= K) k = 0;               // (past the end: read, not used)
        mlxp_cp16(&sw[warp][buf][r * U + u][lane], W + row * K + k);
      }
    }
    mlxp_cp_commit();
  };
  float acc[RL][B], ss[B];
#pragma unroll
  for (int b = 0; b < B; ++b) {
    ss[b] = 0.f;
#pragma unroll
    for (int r = 0; r < RL; ++r) acc[r][b] = 0.f;
  }
  issue(0, 0);
  for (int ci = 0; ci < NCH; ++ci) {
    const int c = ci * U, buf = ci % NB;
    if (ci + 1 < NCH) { issue(c + U, (ci + 1) % NB); mlxp_cp_wait<1>(); }
    else { mlxp_cp_wait<0>(); }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int it = warp + WARPS * (c + u);
      const int k = (it * 32 + lane) * VEC;
      if (it >= IT || k >= K) break;
      float nw[VEC];
      if (NORM) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(norm_w + k));
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) nw[j] = static_cast<float>(e[j]);
      }
      uint4 wv[RL];
#pragma unroll
      for (int r = 0; r < RL; ++r) wv[r] = sw[warp][buf][r * U + u][lane];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(x + (size_t)b * K + k));
        const T* e = reinterpret_cast<const T*>(&v);
        float xf[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          xf[j] = static_cast<float>(e[j]);
          if (NORM) { ss[b] += xf[j] * xf[j]; xf[j] *= nw[j]; }
        }
#pragma unroll
        for (int r = 0; r < RL; ++r) {
          const T* we = reinterpret_cast<const T*>(&wv[r]);
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[r][b] += static_cast<float>(we[j]) * xf[j];
        }
      }
    }
  }
  // reduction: over the lanes (shuffles), then over the warps (shared memory); warp 0
  // ends with every sum in every lane, and lane r * B + b writes that output
#pragma unroll
  for (int b = 0; b < B; ++b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      if (NORM) ss[b] += __shfl_xor_sync(0xffffffffu, ss[b], o);
#pragma unroll
      for (int r = 0; r < RL; ++r) acc[r][b] += __shfl_xor_sync(0xffffffffu, acc[r][b], o);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      red[warp][RL * B + b] = ss[b];
#pragma unroll
      for (int r = 0; r < RL; ++r) red[warp][r * B + b] = acc[r][b];
    }
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int b = 0; b < B; ++b) {
    ss[b] = 0.f;
#pragma unroll
    for (int r = 0; r < RL; ++r) acc[r][b] = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      ss[b] += red[w][RL * B + b];
#pragma unroll
      for (int r = 0; r < RL; ++r) acc[r][b] += red[w][r * B + b];
    }
  }
"""

# the epilogue (after the sums are reduced: every lane of the first warp holds them all;
# lane r * B + b writes output (r, b)), shared with engine.fast.qgemv
GEMV_EPILOGUE = r"""
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int n = n0 + r;
      if (lane != (r * B + b) % 32 || n >= NOUT) continue;
      const float inv = NORM ? rsqrtf(ss[b] / K + EPS_NUM / 1e12f) : 1.f;
      const float gt = static_cast<float>(T(acc[r][b] * inv));
      float res;
      if (EPI == 1) {
        res = static_cast<float>(residual[(size_t)b * NOUT + n]) + gt;
      } else if (EPI == 2) {
        const float ut = static_cast<float>(T(acc[r + R][b] * inv));
        const float s = static_cast<float>(T(gt / (1.f + __expf(-gt))));
        res = s * ut;
      } else {
        res = gt;
      }
      out[(size_t)b * NOUT + n] = T(res);
    }
  }
"""

GEMV_SOURCE = GEMV_MAIN + GEMV_EPILOGUE

# q/k/v with RoPE: the two rows of a rotation pair come out of one block, rotated at
# position pos[0] or pos[b] (PER_ROW) (+ SHIFT, the negative control's fault) and written straight into
# q [B, NQ, 1, D], k and v [B, NKV, 1, D]; v rows are copied unrotated.
GEMV_ROPE_SOURCE = GEMV_MAIN + r"""
  {
    constexpr int HALF = ROPE_D / 2;
    const int head = n0 / HALF, i = n0 % HALF;
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (lane != b) continue;
      const float inv = NORM ? rsqrtf(ss[b] / K + EPS_NUM / 1e12f) : 1.f;
      const float x1 = static_cast<float>(T(acc[0][b] * inv));
      const float x2 = static_cast<float>(T(acc[1][b] * inv));
      if (head >= NQ + NKV) {
        T* dst = v + ((size_t)b * NKV + (head - NQ - NKV)) * ROPE_D;
        dst[i] = T(x1);
        dst[i + HALF] = T(x2);
      } else {
        const float theta = static_cast<float>(pos[PER_ROW ? b : 0] + SHIFT) * inv_freq[i];
        float sn, cs;
        sincosf(theta, &sn, &cs);
        T* dst = head < NQ ? q + ((size_t)b * NQ + head) * ROPE_D
                           : k + ((size_t)b * NKV + (head - NQ)) * ROPE_D;
        dst[i] = T(x1 * cs - x2 * sn);
        dst[i + HALF] = T(x1 * sn + x2 * cs);
      }
    }
  }
"""

def _get_kernel(rope: bool = False):
    from . import kernels as K            # (built there, so that K.empty_kernels covers it)
    if rope:
        return K.cuda_kernel("mlxp_gemv_rope", ["W", "x", "norm_w", "inv_freq", "pos"], ["q", "k", "v"],
                             GEMV_ROPE_SOURCE, GEMV_HEADER)
    return K.cuda_kernel("mlxp_gemv", ["W", "x", "norm_w", "residual"], ["out"], GEMV_SOURCE, GEMV_HEADER)


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
    rpb = rows_per_block(n_out, rows, silu_split is not None)
    dummy = mx.zeros((1,), dt)
    nw = norm[0].astype(dt) if norm is not None else dummy
    res = residual.astype(dt).reshape(rows, n_out) if residual is not None else dummy
    blocks = -(-n_out // rpb)
    (out,) = _get_kernel()(
        inputs=[W, x.astype(dt).reshape(rows, K), nw, res],
        template=[("T", dt), ("K", K), ("NOUT", n_out), ("B", rows), ("R", rpb),
                  ("NORM", int(norm is not None)), ("EPI", epi), ("ROPE_D", 0),
                  ("EPS_NUM", int(round((norm[1] if norm is not None else 0.0) * 1e12)))],
        grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
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
    q, k, v = _get_kernel(rope=True)(
        inputs=[W, x.astype(dt).reshape(rows, K), norm[0].astype(dt), inv_freq, pos.astype(mx.int32)],
        template=[("T", dt), ("K", K), ("NOUT", N), ("B", rows), ("R", 2), ("NORM", 1), ("EPI", 0),
                  ("ROPE_D", head_dim), ("NQ", n_heads), ("NKV", n_kv), ("SHIFT", shift),
                  ("PER_ROW", int(pos.size > 1)),
                  ("EPS_NUM", int(round(norm[1] * 1e12)))],
        grid=(N // 2 * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
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
