"""CUDA sources of the fused GEMV (engine.fast.gemv): one main loop, two epilogues.

`WARP_MAIN`: KSPLIT warps (1, 2 or 4) per output row (a gate row and its up row together for
SiLU·up, the two rows of a rotation pair for RoPE), WARPS_PB warps a block; lane l reads the
16-byte vectors k = (it*32 + l)*VEC of its rows, UNROLL iterations' loads issued before their
products (the weights are read once, streamed past L1: `ld.global.nc.L1::no_allocate`); a
warp-shuffle reduction, then across the row's warps in shared memory. Splitting K keeps enough
loads in flight when a projection has few rows (o_proj, down_proj).

It leaves every lane of the warp that finishes a row with `acc[r][b]` (row r's sum for input
row b; rows R.. are the up rows) and `ss[b]` (sum of squares of input row b, for the norm), and
`n0` the first output row: `GEMV_EPILOGUE` or `ROPE_EPILOGUE` writes the outputs.
"""

from __future__ import annotations

GEMV_HEADER = r"""
__device__ __forceinline__ uint4 mlxp_ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""

# inside the main loop over K: the norm weights at k, then every
# input row's 16 bytes at k (squares summed for the norm) times the staged weight vectors
NORM_LOAD = r"""      float nw[VEC];
      if (NORM) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(norm_w + k));
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) nw[j] = static_cast<float>(e[j]);
      }
"""


def products(w: str) -> str:
    """Every input row b's vector at k times weight vector `w` (an expression over r) of
    each of the RL rows, into acc[r][b]."""
    return r"""#pragma unroll
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
          const T* we = reinterpret_cast<const T*>(&%s);
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[r][b] += static_cast<float>(we[j]) * xf[j];
        }
      }
""" % w


# the epilogue (after the sums are reduced: every lane of the first warp holds them all;
# lane r * B + b writes output (r, b))
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


WARP_MAIN = r"""
  // a unit: output row n0 (+ its up row NOUT + n0 for SiLU·up), or for RoPE the rotation
  // pair (head*D + i, head*D + i + D/2), n0 = the pair's index. KSPLIT warps per unit
  // split K (warp slice ks takes iterations ks, ks + KSPLIT, ...): WARPS_PB / KSPLIT
  // units a block
  constexpr int VEC = 16 / sizeof(T);
  constexpr int IT = (K + 32 * VEC - 1) / (32 * VEC);
  constexpr int RL = (EPI == 2 || ROPE_D) ? 2 : 1;
  constexpr int KS = KSPLIT;
  constexpr int ITS = (IT + KS - 1) / KS;
  constexpr int UN = UNROLL < ITS ? UNROLL : ITS;
  constexpr int HD = ROPE_D ? ROPE_D / 2 : 1;      // (half a head: the pair's stride)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ks = warp % KS;
  const int n0 = (int)blockIdx.x * (WARPS_PB / KS) + warp / KS;
  const bool valid = n0 < (ROPE_D ? NOUT / 2 : NOUT);
  if (KS == 1 && !valid) return;
  const int nr = valid ? n0 : 0;                    // (past the end: row 0 read, not written)
  const T* wr[RL];
#pragma unroll
  for (int r = 0; r < RL; ++r) {
    size_t row;
    if (ROPE_D) row = (size_t)((nr / HD) * ROPE_D + nr % HD + r * HD);
    else row = (size_t)(r ? NOUT + nr : nr);
    wr[r] = W + row * K;
  }
  float acc[RL][B], ss[B];
#pragma unroll
  for (int b = 0; b < B; ++b) {
    ss[b] = 0.f;
#pragma unroll
    for (int r = 0; r < RL; ++r) acc[r][b] = 0.f;
  }
#pragma unroll 1
  for (int i0 = 0; i0 < ITS; i0 += UN) {
    uint4 wv[UN][RL];
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const int it = ks + KS * (i0 + u);
      const int k = (it * 32 + lane) * VEC;
#pragma unroll
      for (int r = 0; r < RL; ++r) {
        if (it < IT && k < K) wv[u][r] = mlxp_ld_stream(wr[r] + k);
        else wv[u][r] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const int it = ks + KS * (i0 + u);
      const int k = (it * 32 + lane) * VEC;
      if (it >= IT || k >= K) break;
""" + NORM_LOAD + products("wv[u][r]") + r"""    }
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
  if (KS > 1) {                                    // the unit's KS warps meet in shared memory
    __shared__ float red[WARPS_PB][RL * B + B];
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < B; ++b) {
        red[warp][RL * B + b] = ss[b];
#pragma unroll
        for (int r = 0; r < RL; ++r) red[warp][r * B + b] = acc[r][b];
      }
    }
    __syncthreads();
    if (ks != 0 || !valid) return;
#pragma unroll
    for (int b = 0; b < B; ++b) {
#pragma unroll
      for (int j = 1; j < KS; ++j) {
        ss[b] += red[warp + j][RL * B + b];
#pragma unroll
        for (int r = 0; r < RL; ++r) acc[r][b] += red[warp + j][r * B + b];
      }
    }
  }
"""

# q/k/v with RoPE: the two rows of a rotation pair come out of one block, rotated at
# position pos[0] or pos[b] (PER_ROW) (+ SHIFT, the negative control's fault) and written straight into
# q [B, NQ, 1, D], k and v [B, NKV, 1, D]; v rows are copied unrotated.
ROPE_EPILOGUE = r"""
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
