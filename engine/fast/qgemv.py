"""The fused matrix-vector product of `engine.fast.gemv` for affine-quantized weights.

MLX's affine quantization (`nn.QuantizedLinear`, `nn.QuantizedEmbedding`; mode "affine")
stores each row as packed unsigned words (element j of a word in bits [BITS*j, BITS*(j+1)))
with one scale and one bias per group of `group_size` elements: w = scale * q + bias. So

    sum_k w_k x_k = sum over groups of  scale * sum_k q_k x_k  +  bias * sum_k x_k.

The kernel: one warp per output row (a gate row and its up row together for SiLU·up);
lane l reads 16 bytes of packed weights per iteration (32 4-bit or 16 8-bit elements,
inside one group), the group's scale and bias, and the matching input elements; the
RMSNorm (as a scale, Σh² in the same pass), the residual add and SiLU·up are the same
epilogues as the float kernel's (`gemv_cuda.GEMV_EPILOGUE`). 4 warps a block, no shared memory.
`supports(module)` says which modules it takes: bits 4 or 8, group size a multiple of
the elements one lane reads, no bias; and only with MLXP_QGEMV=1 (`ENABLED`) for now.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

THREADS = 128
# Opt-in (MLXP_QGEMV=1) until the kernel has been checked on a GPU: its decomposition is
# mirrored on the CPU and it compiles with nvcc, but it has not run on a device yet. Off,
# quantized models keep the L3 step measured so far (MLX's quantized matmul between the
# add+RMSNorm and RoPE kernels).
ENABLED = os.environ.get("MLXP_QGEMV", "0") == "1"

QGEMV_MAIN = r"""
  constexpr int PER_WORD = 32 / BITS;
  constexpr int EPL = 4 * PER_WORD;              // elements a lane reads per iteration
  constexpr int IT = (K + 32 * EPL - 1) / (32 * EPL);
  constexpr int RL = EPI == 2 ? 2 * R : R;
  constexpr int KW = K / PER_WORD;               // packed words per row
  constexpr int NG = K / GS;                     // groups per row
  constexpr int XV = EPL * sizeof(T) / 16;       // 16-byte input loads per iteration
  constexpr int TV = 16 / sizeof(T);
  constexpr unsigned int MASK = (1u << BITS) - 1u;
  const int lane = threadIdx.x & 31;
  const int n0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (n0 >= NOUT) return;
  float acc[RL][B], ss[B];
#pragma unroll
  for (int b = 0; b < B; ++b) {
    ss[b] = 0.f;
#pragma unroll
    for (int r = 0; r < RL; ++r) acc[r][b] = 0.f;
  }
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int k0 = (it * 32 + lane) * EPL;
    if (k0 >= K) break;
    uint4 wv[RL];
    float sc[RL], bi[RL];
#pragma unroll
    for (int r = 0; r < RL; ++r) {
      const int o = min(n0 + (r % R), NOUT - 1);   // (a row past the end: read, not written)
      const size_t row = (EPI == 2 && r >= R) ? (size_t)(NOUT + o) : (size_t)o;
      wv[r] = __ldg(reinterpret_cast<const uint4*>(W + row * KW + k0 / PER_WORD));
      sc[r] = static_cast<float>(scales[row * NG + k0 / GS]);
      bi[r] = static_cast<float>(biases[row * NG + k0 / GS]);
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float xf[EPL];
#pragma unroll
      for (int v = 0; v < XV; ++v) {
        const uint4 t = __ldg(reinterpret_cast<const uint4*>(x + (size_t)b * K + k0) + v);
        const T* e = reinterpret_cast<const T*>(&t);
#pragma unroll
        for (int j = 0; j < TV; ++j) xf[v * TV + j] = static_cast<float>(e[j]);
      }
      float xs = 0.f;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        if (NORM) { ss[b] += xf[j] * xf[j]; xf[j] *= static_cast<float>(norm_w[k0 + j]); }
        xs += xf[j];
      }
#pragma unroll
      for (int r = 0; r < RL; ++r) {
        const unsigned int* wd = reinterpret_cast<const unsigned int*>(&wv[r]);
        float dq = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int e = 0; e < PER_WORD; ++e)
            dq += static_cast<float>((wd[w] >> (BITS * e)) & MASK) * xf[w * PER_WORD + e];
        acc[r][b] += sc[r] * dq + bi[r] * xs;
      }
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      if (NORM) ss[b] += __shfl_xor_sync(0xffffffffu, ss[b], o);
#pragma unroll
      for (int r = 0; r < RL; ++r) acc[r][b] += __shfl_xor_sync(0xffffffffu, acc[r][b], o);
    }
  }
"""


def _source() -> str:
    from .gemv_cuda import GEMV_EPILOGUE
    return QGEMV_MAIN + GEMV_EPILOGUE


def elements_per_lane(bits: int) -> int:
    return 4 * (32 // bits)


def supports(module) -> bool:
    """An affine 4- or 8-bit QuantizedLinear / QuantizedEmbedding without bias whose groups
    hold whole lane reads and whose rows split into them."""
    from .kernels import DISABLED
    if (not ENABLED or "qgemv" in DISABLED
            or type(module) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or "bias" in module):
        return False
    if getattr(module, "mode", "affine") != "affine" or module.bits not in (4, 8):
        return False
    epl = elements_per_lane(module.bits)
    k = module.weight.shape[1] * (32 // module.bits)
    return module.group_size % epl == 0 and k % epl == 0 and "biases" in module


def in_features(module) -> int:
    return module.weight.shape[1] * (32 // module.bits)


def rows_per_warp(batch: int, silu: bool) -> int:
    """1 for one input row; for a batch, up to 4 (2 with SiLU), accumulators <= 32 per lane."""
    per = 2 if silu else 1
    return 1 if batch == 1 else max(1, min(4 // per, 32 // (per * batch)))


def linear(module, x: mx.array, n_out: int, *, norm: Optional[Tuple[mx.array, float]], residual,
           silu_split: Optional[int]) -> mx.array:
    """The kernel (CUDA only; `gemv.linear` dispatches here and keeps the stock path)."""
    from . import kernels as K
    Kd = x.shape[-1]
    rows = x.size // Kd
    dt = x.dtype if x.dtype in (mx.bfloat16, mx.float16, mx.float32) else module.scales.dtype
    epi = 2 if silu_split is not None else (1 if residual is not None else 0)
    R = rows_per_warp(rows, silu_split is not None)
    dummy = mx.zeros((1,), dt)
    nw = norm[0].astype(dt) if norm is not None else dummy
    res = residual.astype(dt).reshape(rows, n_out) if residual is not None else dummy
    warps = -(-n_out // R)
    kern = K.cuda_kernel("mlxp_qgemv", ["W", "scales", "biases", "x", "norm_w", "residual"], ["out"],
                         _source())
    (out,) = kern(
        inputs=[module.weight, module.scales, module.biases, x.astype(dt).reshape(rows, Kd), nw, res],
        template=[("T", dt), ("K", Kd), ("NOUT", n_out), ("B", rows), ("R", R), ("BITS", module.bits),
                  ("GS", module.group_size), ("NORM", int(norm is not None)), ("EPI", epi),
                  ("EPS_NUM", int(round((norm[1] if norm is not None else 0.0) * 1e12)))],
        grid=(-(-warps // (THREADS // 32)) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, n_out)], output_dtypes=[dt])
    return out.reshape(*x.shape[:-1], n_out)
