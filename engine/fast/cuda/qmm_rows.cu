// Affine 4-bit weights times a few input rows on the tensor cores (engine.fast.qmm): the
// projections of the fast step for the rows one call of the one-kernel step does not take.
//
// y[m][n] = sum_k W[n][k] x[m][k], W[n][k] = scale[n][k / GS] * q[n][k] + bias[n][k / GS], q the
// 4-bit values packed 8 to a 32-bit word (value e of a word at bits 4e: MLX's layout), M rows of
// x (bf16), MT = ceil(M / 8) groups of 8 batch rows, each the N side of an mma.m16n8k16.
//
// A warp takes a tile of 16 weight rows (EPI 2: 8 gate rows g and their 8 up rows NOUT + g, so
// a lane holds a gate sum and its up sum), KS warps of a block split K in chunks of 128
// columns (warp ks: chunks ks, ks + KS, ...), WARPS / KS tiles a block. In a chunk, lane
// (g = lane / 4, q = lane % 4) reads 16 bytes (32 values) of its two rows (tile rows g and
// g + 8) at columns 32q .. 32q + 31, their scale and bias (one group: GS >= 32), and 64 bytes
// of input row 8t + g for each group t. Its word w gives four mma's worth of A fragments: the
// nibble pairs (e, e + 4) come out of one mask as a bf16x2 (the bits put under the exponent
// of 128, 128 taken off: exact), scaled and biased with one bf16x2 fma (the weight MLX's
// dequantize gives, rounded to bf16). The fragment's columns are thus taken in a permuted
// order (2q <-> nibble 2h, 2q + 1 <-> 2h + 4, 2q + 8 <-> 2h + 1, 2q + 9 <-> 2h + 5 of word w,
// h = 0, 1), and the input's B fragment takes its columns in the same order (two byte
// permutes of the 16 bytes of x for word w): a dot product does not see the order
// (engine.fast.qmm.mirror checks the mapping in numpy). Float accumulation; UN chunks' weight
// loads in flight before their products (streamed past L1); the KS warps' sums added in
// shared memory; the output rounded to T once, then the epilogue:
//   EPI 0: y = T(acc); EPI 1: y = T(residual + T(acc)); EPI 2: y = T(T(silu(T(gate))) * T(up))
// (the roundings of the fused GEMV, gemv_epilogue.cu).
  constexpr int CH = K / 128;                      // chunks of 128 columns
  constexpr int WPR = K / 8;                       // words a weight row
  constexpr int GPR = K / GS;                      // groups a weight row
  constexpr int TPB = WARPS / KS;                  // tiles a block
  constexpr int NT = EPI == 2 ? NOUT / 8 : NOUT / 16;   // tiles
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3, ks = warp % KS;
  const int tile = (int)blockIdx.x * TPB + warp / KS;
  const bool valid = tile < NT;
  const int tl = valid ? tile : 0;                 // (past the end: tile 0 read, not written)
  // the lane's two weight rows
  const int rowA = EPI == 2 ? 8 * tl + g : 16 * tl + g;
  const int rowB = EPI == 2 ? NOUT + 8 * tl + g : 16 * tl + 8 + g;
  const unsigned int* wA = w + (size_t)rowA * WPR;
  const unsigned int* wB = w + (size_t)rowB * WPR;
  float c[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.f;
  const __nv_bfloat162 k128 = __floats2bfloat162_rn(128.f, 128.f);
  constexpr int ITS = (CH + KS - 1) / KS;
#pragma unroll 1
  for (int i0 = 0; i0 < ITS; i0 += UN) {
    uint4 va[UN], vb[UN];
    __nv_bfloat162 sa[UN], ba[UN], sb[UN], bb[UN];
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const int ch = ks + KS * (i0 + u);
      if (i0 + u < ITS && ch < CH) {
        const int k0 = ch * 128 + 32 * q;
        va[u] = mlxp_ld_stream(wA + k0 / 8);
        vb[u] = mlxp_ld_stream(wB + k0 / 8);
        const T s0 = scales[(size_t)rowA * GPR + k0 / GS], b0 = biases[(size_t)rowA * GPR + k0 / GS];
        const T s1 = scales[(size_t)rowB * GPR + k0 / GS], b1 = biases[(size_t)rowB * GPR + k0 / GS];
        sa[u] = __nv_bfloat162(s0, s0); ba[u] = __nv_bfloat162(b0, b0);
        sb[u] = __nv_bfloat162(s1, s1); bb[u] = __nv_bfloat162(b1, b1);
      }
    }
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const int ch = ks + KS * (i0 + u);
      if (i0 + u >= ITS || ch >= CH) break;
      const int k0 = ch * 128 + 32 * q;
      uint4 xv[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const int m = 8 * t + g;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          xv[t][j] = m < M ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K + k0) + j)
                           : make_uint4(0u, 0u, 0u, 0u);
      }
      const unsigned int* wa = reinterpret_cast<const unsigned int*>(&va[u]);
      const unsigned int* wb = reinterpret_cast<const unsigned int*>(&vb[u]);
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          unsigned int a[4];
          const unsigned int src[4] = {wa[wd] >> (8 * h), wb[wd] >> (8 * h), wa[wd] >> (8 * h + 4),
                                       wb[wd] >> (8 * h + 4)};
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const unsigned int bits = (src[r] & 0x000F000Fu) | 0x43004300u;
            __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&bits);
            v = __hsub2(v, k128);
            v = (r & 1) ? __hfma2(v, sb[u], bb[u]) : __hfma2(v, sa[u], ba[u]);
            a[r] = *reinterpret_cast<const unsigned int*>(&v);
          }
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const unsigned int lo = h ? xv[t][wd].y : xv[t][wd].x;
            const unsigned int hi = h ? xv[t][wd].w : xv[t][wd].z;
            const unsigned int b0 = __byte_perm(lo, hi, 0x5410), b1 = __byte_perm(lo, hi, 0x7632);
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(c[t][0]), "+f"(c[t][1]), "+f"(c[t][2]), "+f"(c[t][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
          }
        }
      }
    }
  }
  if (KS > 1) {                                    // the tile's KS warps meet in shared memory
    __shared__ float red[WARPS][MT * 4][32];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][t * 4 + e][lane] = c[t][e];
    __syncthreads();
    if (ks != 0) return;
#pragma unroll
    for (int j = 1; j < KS; ++j)
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[t][e] += red[warp + j][t * 4 + e][lane];
  }
  if (!valid) return;
  // accumulator e of the lane: row g (e < 2) or g + 8, batch row 8t + 2q + (e & 1)
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const int m = 8 * t + 2 * q + e2;
      if (m >= M) continue;
      if (EPI == 2) {
        const int n = 8 * tl + g;
        const float gt = static_cast<float>(T(c[t][e2]));
        const float ut = static_cast<float>(T(c[t][2 + e2]));
        const float s = static_cast<float>(T(gt / (1.f + __expf(-gt))));
        y[(size_t)m * NOUT + n] = T(s * ut);
      } else {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int n = 16 * tl + g + 8 * hr;
          const float v = static_cast<float>(T(c[t][2 * hr + e2]));
          y[(size_t)m * NOUT + n] = EPI == 1 ? T(static_cast<float>(residual[(size_t)m * NOUT + n]) + v) : T(v);
        }
      }
    }
  }
