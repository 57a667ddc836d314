// The fused GEMV's main loop (engine.fast.gemv): KSPLIT warps (1, 2 or 4) per output unit (a
// row, a gate row and its up row together for SiLU·up, or the two rows of a rotation pair for
// RoPE), WARPS_PB warps a block; lane l reads the 16-byte vectors k = (it*32 + l)*VEC of its
// rows, UNROLL iterations' loads issued before their products (the weights are read once,
// streamed past L1: mlxp_ld_stream); the RMSNorm folded in as a scale (the sum of squares of
// the input accumulated in the same pass); a warp-shuffle reduction, then across the unit's
// warps in shared memory. It leaves every lane of the warp that finishes a unit with acc[r][b]
// (row r's sum for input row b; rows R.. are the up rows), ss[b] (input row b's sum of squares)
// and n0 (the unit): gemv_epilogue.cu or gemv_rope_epilogue.cu writes the outputs.
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
      float nw[VEC];
      if (NORM) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(norm_w + k));
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) nw[j] = static_cast<float>(e[j]);
      }
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
          const T* we = reinterpret_cast<const T*>(&wv[u][r]);
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[r][b] += static_cast<float>(we[j]) * xf[j];
        }
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
