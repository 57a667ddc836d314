"""Matrix-vector products for the decode step, with the neighbouring work fused in.

`linear(module, x, ...)` computes `module(x)` for a few rows of x (decode: one token
per row) and optionally folds in what surrounds a projection in a decoder layer:

- `norm=(weight, eps)`: x is the residual stream and is RMS-normalised on the fly
  (the layer norm before q/k/v, before gate/up, and the final norm before the head);
- `residual=h`: returns `h + module(x)` (the residual add after o_proj and down_proj);
- `silu_split=I`: the module is a merged gate/up projection (gate rows first, then up);
  returns `silu(gate) * up`, shape [.., I].

On an NVIDIA GPU (`use_kernel=True`) this is one CUDA kernel (`mx.fast.cuda_kernel`,
compiled at run time): a block of 256 threads owns a few output rows, every thread
reads 16-byte vectors of those rows spread over the whole K axis (all of its loads
are issued before any arithmetic, so many bytes are in flight), the block reduces
the partial dot products in shared memory and applies the epilogue. The input rows
are read once per block and reused for all of its output rows and batch rows.
Otherwise the same computation runs with stock MLX operations, in the order the
model's own modules use (so on the CPU the result is the L1 result bit for bit).

Float weights only (bf16, fp16, fp32), no bias; `supports(module)` says whether a
module can take the kernel.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 8          # batch rows per kernel call (more: stock matmul)
THREADS = 256
# weight vectors (16 bytes) each thread keeps in flight; $MLXP_GEMV_VECS to tune
VEC_BUDGET = int(os.environ.get("MLXP_GEMV_VECS", "16"))
MIN_BLOCKS = int(os.environ.get("MLXP_GEMV_BLOCKS", "512"))

GEMV_SOURCE = r"""
  constexpr int VEC = 16 / sizeof(T);
  constexpr int STRIDE = 256 * VEC;
  constexpr int IT = (K + STRIDE - 1) / STRIDE;
  constexpr int RL = EPI == 2 ? 2 * ROWS : ROWS;
  constexpr int NW = 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n0 = blockIdx.x * ROWS;
  __shared__ float red[NW][RL * B];

  // 1. every weight vector this thread needs, loaded before any arithmetic
  uint4 wv[RL][IT];
#pragma unroll
  for (int r = 0; r < RL; ++r) {
    const int o = n0 + (r % ROWS);
    const size_t row = (EPI == 2 && r >= ROWS) ? (size_t)(NOUT + o) : (size_t)o;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int k = (it * 256 + tid) * VEC;
      wv[r][it] = (o < NOUT && k < K) ? *reinterpret_cast<const uint4*>(W + row * K + k)
                                      : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // 2. RMS statistics of the input rows (only when the norm is folded in)
  float inv[B];
#pragma unroll
  for (int b = 0; b < B; ++b) inv[b] = 1.f;
  if (NORM) {
    float ss[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      ss[b] = 0.f;
#pragma unroll
      for (int it = 0; it < IT; ++it) {
        const int k = (it * 256 + tid) * VEC;
        if (k < K) {
          const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)b * K + k);
          const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) { const float f = static_cast<float>(e[j]); ss[b] += f * f; }
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss[b] += __shfl_xor_sync(0xffffffffu, ss[b], o);
      if (lane == 0) red[warp][b] = ss[b];
    }
    __syncthreads();
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) t += red[w][b];
      inv[b] = rsqrtf(t / K + EPS_NUM / 1e12f);
    }
    __syncthreads();
  }

  // 3. partial dot products
  float acc[RL][B];
#pragma unroll
  for (int r = 0; r < RL; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int k = (it * 256 + tid) * VEC;
    if (k >= K) break;
    float xf[B][VEC];
    float nw[VEC];
    if (NORM) {
      const uint4 v = *reinterpret_cast<const uint4*>(norm_w + k);
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) nw[j] = static_cast<float>(e[j]);
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)b * K + k);
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = static_cast<float>(e[j]);
        xf[b][j] = NORM ? static_cast<float>(T(nw[j] * static_cast<float>(T(f * inv[b])))) : f;
      }
    }
#pragma unroll
    for (int r = 0; r < RL; ++r) {
      const T* e = reinterpret_cast<const T*>(&wv[r][it]);
      float wf[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) wf[j] = static_cast<float>(e[j]);
#pragma unroll
      for (int b = 0; b < B; ++b)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[r][b] += wf[j] * xf[b][j];
    }
  }

  // 4. block reduction and the epilogue
#pragma unroll
  for (int r = 0; r < RL; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float v = acc[r][b];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) red[warp][r * B + b] = v;
    }
  __syncthreads();
  for (int i = tid; i < ROWS * B; i += 256) {
    const int r = i / B, b = i % B, n = n0 + r;
    if (n >= NOUT) continue;
    float g = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) g += red[w][r * B + b];
    const float gt = static_cast<float>(T(g));
    float res;
    if (EPI == 1) {
      res = static_cast<float>(residual[(size_t)b * NOUT + n]) + gt;
    } else if (EPI == 2) {
      float u = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) u += red[w][(r + ROWS) * B + b];
      const float s = static_cast<float>(T(gt / (1.f + __expf(-gt))));
      res = s * static_cast<float>(T(u));
    } else {
      res = gt;
    }
    out[(size_t)b * NOUT + n] = T(res);
  }
"""

_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mlxp_gemv", input_names=["W", "x", "norm_w", "residual"],
                                      output_names=["out"], source=GEMV_SOURCE)
    return _kernel


def supports(module) -> bool:
    """A plain float Linear (or an Embedding used as the output head) without bias."""
    if type(module) not in (nn.Linear, nn.Embedding) or "bias" in module:
        return False
    w = module.weight
    return w.dtype in (mx.bfloat16, mx.float16, mx.float32) and w.shape[1] % (16 // w.itemsize) == 0


def rows_per_block(n_out: int, k: int, batch: int, itemsize: int, silu: bool,
                   vecs: Optional[int] = None, min_blocks: Optional[int] = None) -> int:
    """Output rows per block: as many as keep <= `vecs` (VEC_BUDGET) weight vectors and
    <= 32 accumulators per thread, while leaving >= `min_blocks` (MIN_BLOCKS) blocks where
    the matrix allows (to fill the GPU)."""
    vecs = VEC_BUDGET if vecs is None else vecs
    min_blocks = MIN_BLOCKS if min_blocks is None else min_blocks
    it = -(-k // (THREADS * (16 // itemsize)))
    per = 2 if silu else 1
    rows = 8
    while rows > 1 and (rows * per * it > vecs or rows * per * batch > 32 or n_out // rows < min_blocks):
        rows //= 2
    return rows


def _silu_gate(gate, up):
    return nn.silu(gate) * up


def _standin(module, x, norm, residual, silu_split, gate_fn):
    if norm is not None:
        x = mx.fast.rms_norm(x, norm[0], norm[1])
    y = module.as_linear(x) if isinstance(module, nn.Embedding) else module(x)
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
    if not use_kernel or rows > MAX_ROWS or not supports(module):
        return _standin(module, x, norm, residual, silu_split, gate_fn)
    W = module.weight
    N = W.shape[0]
    n_out = silu_split if silu_split is not None else N
    if silu_split is not None and N != 2 * silu_split:
        raise ValueError("silu_split needs a merged gate/up weight of 2 * I rows")
    if W.shape[1] != K:
        raise ValueError(f"input has {K} features, the weight {W.shape[1]}")
    dt = W.dtype
    epi = 2 if silu_split is not None else (1 if residual is not None else 0)
    rpb = rows_per_block(n_out, K, rows, W.itemsize, silu_split is not None)
    dummy = mx.zeros((1,), dt)
    nw = norm[0].astype(dt) if norm is not None else dummy
    res = residual.astype(dt).reshape(rows, n_out) if residual is not None else dummy
    blocks = -(-n_out // rpb)
    (out,) = _get_kernel()(
        inputs=[W, x.astype(dt).reshape(rows, K), nw, res],
        template=[("T", dt), ("K", K), ("NOUT", n_out), ("B", rows), ("ROWS", rpb),
                  ("NORM", int(norm is not None)), ("EPI", epi),
                  ("EPS_NUM", int(round((norm[1] if norm is not None else 0.0) * 1e12)))],
        grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, n_out)], output_dtypes=[dt])
    return out.reshape(*x.shape[:-1], n_out)
