"""CUDA sources of the fused GEMV (engine.fast.gemv): two main loops, one epilogue.

- `WARP_MAIN` (the default, `MLXP_GEMV_KERNEL=warp`): KSPLIT warps (1, 2 or 4) per output
  row (a gate row and its up row together for SiLU·up, the two rows of a rotation pair for
  RoPE), WARPS_PB warps a block; lane l reads the 16-byte vectors k = (it*32 + l)*VEC of
  its rows, UNROLL iterations' loads issued before their products (the weights are read
  once, streamed past L1: `ld.global.nc.L1::no_allocate`); a warp-shuffle reduction, then
  across the row's warps in shared memory. Splitting K keeps enough loads in flight when a
  projection has few rows (o_proj, down_proj).
- `SPLIT_MAIN` (`MLXP_GEMV_KERNEL=split`): a block of 4 warps per output row splitting K,
  the weights staged through shared memory with cp.async.

Both leave every lane of the warp that finishes a row with `acc[r][b]` (row r's sum for
input row b; rows R.. are the up rows) and `ss[b]` (sum of squares of input row b, for
the norm), and `n0` the first output row: `GEMV_EPILOGUE` (shared with engine.fast.qgemv)
or `ROPE_EPILOGUE` writes the outputs.
"""

from __future__ import annotations

# The weight vectors go through shared memory with cp.async (sm_80+): all of a chunk's
# copies are in flight at once whatever the compiler's schedule (plain loads into
# registers get interleaved with the arithmetic, leaving ~2 loads in flight), and the
# next chunk is copied while the current one is multiplied.
GEMV_HEADER = r"""
__device__ __forceinline__ void mlxp_cp16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ uint4 mlxp_ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void mlxp_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void mlxp_cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
"""

# shared by both main loops, inside their loop over K: the norm weights at k, then every
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


SPLIT_MAIN = r"""
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
""" + NORM_LOAD + r"""      uint4 wv[RL];
#pragma unroll
      for (int r = 0; r < RL; ++r) wv[r] = sw[warp][buf][r * U + u][lane];
""" + products("wv[r]") + r"""    }
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
