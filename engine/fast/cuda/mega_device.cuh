// Device functions of the one-kernel decode step (mega_step.cu):
// - mega_grid_sync: the grid barrier (an atomic counter every block adds to and waits on; a
//   10 s limit on the wait turns a never-arriving block into a CUDA error, not a hang);
// - mega_ld_w: a 16-byte weight load streamed past L1; mega_ldcg_t: an element other blocks
//   wrote during the step, read from L2 (mega_ldcg_vec, mega_ldcg_raw: a lane's contiguous
//   elements in one load, as floats or kept as they are);
// - mega_dot: RL float weight rows dotted with RB input rows held in shared memory, a warp per
//   unit, UN 16-byte loads in flight per lane, a shuffle reduction;
// - mega_qdot: the same for affine-quantized rows (4-bit ones of a bf16 model on the tensor
//   cores: mega_qdot4_mma), its inputs kept swizzled in shared memory
//   (mega_sw) so that lanes reading 64-128 contiguous bytes each do not collide on banks;
// - mega_ldx: inputs read from shared memory in 16-byte loads;
// - mega_stage: a phase's input vector (floats other blocks wrote) into shared memory, each
//   thread's 16-byte loads issued together before any is used;
// - mega_mat_dot: either, by the kernel's QB (0: float weights);
// - mega_wait_at_least / mega_atom_add_acq_rel: the per-head flags of FLOW and the chunk
//   counters of the attention phase (acquire / release ordering).
// It also gives every kernel of the module __launch_bounds__(512, 1) (the generated signature
// takes no attributes), so the compiler keeps to the registers one block of 512 threads per SM
// allows.
#include "faults.cuh"
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(512, 1)
#define MEGA_SYNC() __syncthreads()
__device__ __forceinline__ unsigned int mega_ld_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
template <int N> struct mega_int { static constexpr int value = N; };
__host__ __device__ constexpr int mega_cmax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned long long mega_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// wait until *p >= want (acquire load); a wait over 10 s (blocks that never arrive: not all
// resident at once) stops the kernel with an error rather than hanging the process
__device__ __forceinline__ void mega_wait_at_least(const unsigned int* p, unsigned int want) {
  const unsigned long long t0 = mega_now();
  unsigned int spins = 0;
  while (mega_ld_acquire(p) < want) {
    if ((++spins & 0xFFFFu) == 0u && mega_now() - t0 > 10000000000ull) __trap();
  }
}
// all blocks meet here; `target` counts the arrivals every block waits for (at most 10 s:
// mega_wait_at_least). A block arrives with one release-add (no separate fence), and the
// acquire load of the wait orders what follows (no fence after it).
__device__ __forceinline__ void mega_grid_sync(unsigned int* ctr, unsigned int& target) {
  MEGA_SYNC();
  target += gridDim.x;
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(ctr) : "memory");
    mega_wait_at_least(ctr, target);
  }
  MEGA_SYNC();
}
// the L2 eviction policy of the weight loads: evict-first (each weight is read once a step)
__device__ __forceinline__ unsigned long long mega_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 mega_ld_w(const void* p, unsigned long long pol) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
template <typename T>
__device__ __forceinline__ float mega_ldcg_t(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return __ldcg(reinterpret_cast<const float*>(p));
  } else {
    const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
    return static_cast<float>(*reinterpret_cast<const T*>(&u));
  }
}
// N contiguous elements other blocks wrote during the step, read from L2 and kept as they are
// (converted where they are used): one load where N * sizeof(T) is 2, 4, 8 or 16 bytes
template <typename T, int N> struct mega_vals { T e[N]; };
template <typename T, int N>
__device__ __forceinline__ mega_vals<T, N> mega_ldcg_raw(const T* p) {
  constexpr int BY = N * (int)sizeof(T);
  mega_vals<T, N> out;
  if constexpr (BY == 2 || BY == 4 || BY == 8 || BY == 16) {
    union { uint4 u4; uint2 u2; unsigned int u1; unsigned short u0; T e[N]; } v;
    if constexpr (BY == 16) v.u4 = __ldcg(reinterpret_cast<const uint4*>(p));
    else if constexpr (BY == 8) v.u2 = __ldcg(reinterpret_cast<const uint2*>(p));
    else if constexpr (BY == 4) v.u1 = __ldcg(reinterpret_cast<const unsigned int*>(p));
    else v.u0 = __ldcg(reinterpret_cast<const unsigned short*>(p));
#pragma unroll
    for (int j = 0; j < N; ++j) out.e[j] = v.e[j];
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out.e[j] = T(mega_ldcg_t(p + j));
  }
  return out;
}
// the same as floats
template <typename T, int N>
__device__ __forceinline__ void mega_ldcg_vec(const T* p, float* out) {
  const mega_vals<T, N> v = mega_ldcg_raw<T, N>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = static_cast<float>(v.e[j]);
}
// an add to a counter with release (what the lane and, after a __syncwarp, its warp wrote
// before) and acquire (what the others wrote before their adds) semantics; the old value
__device__ __forceinline__ unsigned int mega_atom_add_acq_rel(unsigned int* p, unsigned int v) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ float mega_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float mega_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// N elements of shared memory from p (16-byte aligned, N a multiple of 16 / sizeof(X)) as
// floats, in 16-byte loads
template <typename X, int N>
__device__ __forceinline__ void mega_ldx(const X* p, float* out) {
  constexpr int CH = 16 / sizeof(X);
#pragma unroll
  for (int c = 0; c < N / CH; ++c) {
    const uint4 v = *reinterpret_cast<const uint4*>(p + c * CH);
    const X* e = reinterpret_cast<const X*>(&v);
#pragma unroll
    for (int j = 0; j < CH; ++j) out[c * CH + j] = static_cast<float>(e[j]);
  }
}
// N floats other blocks wrote during the step (src: 16-byte aligned, N a multiple of 4) into
// shared memory as X, element k at dst[sw(k)]: a thread takes every THREADS-th group of 4 and
// issues its 16-byte L2 loads (up to 8) before it stores any, so the block waits one round
// trip, not one per element (the values stored are the same as element-wise copies')
template <typename X, int N, int THREADS, typename SW>
__device__ __forceinline__ void mega_stage(const float* src, X* dst, SW sw) {
  constexpr int N4 = N / 4, PER = (N4 + THREADS - 1) / THREADS, B = PER < 8 ? PER : 8;
  const float4* s4 = reinterpret_cast<const float4*>(src);
#pragma unroll 1
  for (int j0 = 0; j0 < PER; j0 += B) {
    // (every load unconditional, past the end clamped to the last group: no predicated
    // register array for the compiler to keep in local memory)
    float4 v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) v[j] = __ldcg(s4 + min(threadIdx.x + min(j0 + j, PER - 1) * THREADS, N4 - 1));
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const int q = threadIdx.x + (j0 + j) * THREADS;
      if (j0 + j < PER && q < N4) {
        dst[sw(4 * q)] = X(v[j].x);
        dst[sw(4 * q + 1)] = X(v[j].y);
        dst[sw(4 * q + 2)] = X(v[j].z);
        dst[sw(4 * q + 3)] = X(v[j].w);
      }
    }
  }
}
// a small unsigned integer (< 2^23) as a float, exactly: its bits put under the exponent
// of 2^23, then 2^23 taken off (logic ops and an add instead of a conversion instruction)
__device__ __forceinline__ float mega_q2f(unsigned int q) {
  return __uint_as_float(q | 0x4B000000u) - 8388608.f;
}
// where element i of a quantized dot's input is kept in shared memory: its 16-byte chunk c
// swapped within each run of 8 chunks (c ^ (c / 8 % 8)), so that the 32 lanes, each
// reading a run of chunks of its own, hit different banks
template <typename X>
__device__ __forceinline__ int mega_sw(int i) {
  constexpr int CH = 16 / sizeof(X);
  const int c = i / CH;
  return (c ^ ((c >> 3) & 7)) * CH + i % CH;
}
// RL weight rows of K elements dotted with RB input rows (shared memory, float or T,
// row b's elements koff .. koff + K at xs + b * KT + koff); every lane ends with the sums
// acc[r * RB + b]. K is a multiple of 32 * VEC; weight loads take the L2 policy pol.
template <typename T, typename X, int K, int RL, int RB, int UN, int KT>
__device__ __forceinline__ void mega_dot(const T* const* rows, const X* xs, int koff, int lane,
                                         float* acc, unsigned long long pol) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int IT = K / (32 * VEC);
#pragma unroll
  for (int r = 0; r < RL * RB; ++r) acc[r] = 0.f;
  auto load = [&](int i0, uint4 (&wv)[UN][RL]) {
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      if (i0 + u < IT) {
#pragma unroll
        for (int r = 0; r < RL; ++r) wv[u][r] = mega_ld_w(rows[r] + ((i0 + u) * 32 + lane) * VEC, pol);
      }
    }
  };
  auto consume = [&](int i0, const uint4 (&wv)[UN][RL]) {
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      if (i0 + u >= IT) break;
      const int k = ((i0 + u) * 32 + lane) * VEC;
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        float xv[VEC];
        mega_ldx<X, VEC>(xs + b * KT + koff + k, xv);
#pragma unroll
        for (int r = 0; r < RL; ++r) {
          const T* we = reinterpret_cast<const T*>(&wv[u][r]);
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[r * RB + b] += static_cast<float>(we[j]) * xv[j];
        }
      }
    }
  };
#pragma unroll 1
  for (int i0 = 0; i0 < IT; i0 += UN) {
    uint4 wv[UN][RL];
    load(i0, wv);
    consume(i0, wv);
  }
#pragma unroll
  for (int r = 0; r < RL * RB; ++r) acc[r] = mega_warp_sum(acc[r]);
}
template <class A, class B> struct mega_same { static constexpr bool value = false; };
template <class A> struct mega_same<A, A> { static constexpr bool value = true; };
// a lane's loads for iterations i0 .. i0 + UN - 1 (those below IT) of RL quantized rows: the
// 16-byte word of each row, and its group's scale and bias as S (float, or a bf16 pair of it)
template <typename S, typename T, int UN, int RL, int IT, int EPL, int PER_WORD, int GS>
__device__ __forceinline__ void mega_qload(const unsigned int* const* rows, const T* const* sc,
                                           const T* const* bi, int i0, int lane, uint4 (&wv)[UN][RL],
                                           S (&s)[UN][RL], S (&bb)[UN][RL], unsigned long long pol) {
  auto as = [](T v) -> S { if constexpr (mega_same<S, float>::value) return static_cast<float>(v); else return S(v, v); };
#pragma unroll
  for (int u = 0; u < UN; ++u) {
    if (i0 + u < IT) {
      const int k0 = ((i0 + u) * 32 + lane) * EPL;
#pragma unroll
      for (int r = 0; r < RL; ++r) {
        wv[u][r] = mega_ld_w(rows[r] + k0 / PER_WORD, pol);
        s[u][r] = as(sc[r][k0 / GS]);
        bb[u][r] = as(bi[r][k0 / GS]);
      }
    }
  }
}
// The same for MLX's affine-quantized rows (BITS 4 or 8, groups of GS): row r's packed
// words at rows[r], its group scales and biases at sc[r], bi[r]; lane l reads 16 bytes
// (EPL elements, inside one group) per iteration and adds scale * sum(q x) + bias * sum(x),
// (each 4-bit value made a float by putting its bits under the exponent of 2^23: mega_q2f).
template <typename T, typename X, int K, int RL, int RB, int UN, int BITS, int GS, int KT>
__device__ __forceinline__ void mega_qdot(const unsigned int* const* rows, const T* const* sc,
                                          const T* const* bi, const X* xs, int koff, int lane,
                                          float* acc, unsigned long long pol) {
  constexpr int PER_WORD = 32 / BITS, EPL = 4 * PER_WORD, IT = K / (32 * EPL);
  constexpr unsigned int MASK = (1u << BITS) - 1u;
#pragma unroll
  for (int r = 0; r < RL * RB; ++r) acc[r] = 0.f;
#pragma unroll 1
  for (int i0 = 0; i0 < IT; i0 += UN) {
    uint4 wv[UN][RL];
    float s[UN][RL], bb[UN][RL];
    mega_qload<float, T, UN, RL, IT, EPL, PER_WORD, GS>(rows, sc, bi, i0, lane, wv, s, bb, pol);
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      if (i0 + u >= IT) break;
      const int k0 = ((i0 + u) * 32 + lane) * EPL;
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        float xf[EPL], xsum = 0.f;
        constexpr int CH = 16 / sizeof(X);
#pragma unroll
        for (int c = 0; c < EPL / CH; ++c)    // 16-byte chunks, stored swizzled (mega_sw)
          mega_ldx<X, CH>(xs + mega_sw<X>(b * KT + koff + k0 + c * CH), xf + c * CH);
#pragma unroll
        for (int j = 0; j < EPL; ++j) xsum += xf[j];
#pragma unroll
        for (int r = 0; r < RL; ++r) {
          const unsigned int* wd = reinterpret_cast<const unsigned int*>(&wv[u][r]);
          float dq = 0.f;
#pragma unroll
          for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int e = 0; e < PER_WORD; ++e)
              dq += mega_q2f((wd[w] >> (BITS * e)) & MASK) * xf[w * PER_WORD + e];
          acc[r * RB + b] += s[u][r] * dq + bb[u][r] * xsum;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RL * RB; ++r) acc[r] = mega_warp_sum(acc[r]);
}
// 4-bit rows on the tensor cores (mega_qdot's path for bf16 models): lane l still reads its
// 16 bytes (32 values of one group) of each row per iteration, but dequantizes them to bf16
// pairs — nibbles (j, j + 4) of a word come out of one mask as a bf16x2 (bits under the
// exponent of 128, 128 taken off: exact), then scale * q + bias in one bf16x2 fma (the weight
// MLX's dequantize gives, rounded to bf16) — and its inputs to the matching bf16 pairs, and
// hands both to mma.m16n8k16 as the lane's own fragment: A row g (lane g = l / 4, q = l % 4)
// holds row 2p's pairs, A row g + 8 row 2p + 1's, B column g the inputs. D[g][g] (and
// D[g + 8][g]) then sums the products of lanes 4g .. 4g + 3 only, each with its own weights and
// inputs (a dot does not see the order of its terms); the other entries are not used. After
// the last iteration lane (g, g / 2) holds row 2p's D[g][g] in c[g % 2] and row 2p + 1's in
// c[2 + g % 2], and a warp sum of those gives the dot (engine.fast.qmm.diag_mirror follows the
// lanes in numpy). Float accumulation on the tensor cores; ~90 instructions a lane-iteration
// where the scalar path takes ~200 (H100, 8B 4-bit: the step 4,097 µs against 4,834; its phases
// are then bound by memory latency more than by issue: reports/l3/JOURNAL.md, 0.5.8).
__device__ __forceinline__ unsigned int mega_deq2(unsigned int src, __nv_bfloat162 s, __nv_bfloat162 b) {
  const unsigned int bits = (src & 0x000F000Fu) | 0x43004300u;
  __nv_bfloat162 v = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&bits), __floats2bfloat162_rn(128.f, 128.f));
  v = __hfma2(v, s, b);
  return *reinterpret_cast<const unsigned int*>(&v);
}
// the 16 bf16 pairs of a lane's 32 inputs (element k0 .. k0 + 31 of row-offset `base`, stored
// swizzled): pair 4 w + j = (x[8 w + j], x[8 w + j + 4]), the order mega_deq2 gives the weights
template <typename X>
__device__ __forceinline__ void mega_xpairs(const X* xs, int base, unsigned int* xp) {
  if constexpr (sizeof(X) == 4) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float4 lo = *reinterpret_cast<const float4*>(xs + mega_sw<X>(base + 8 * w));
      const float4 hi = *reinterpret_cast<const float4*>(xs + mega_sw<X>(base + 8 * w + 4));
      const float l4[4] = {lo.x, lo.y, lo.z, lo.w}, h4[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 p = __floats2bfloat162_rn(l4[j], h4[j]);
        xp[4 * w + j] = *reinterpret_cast<const unsigned int*>(&p);
      }
    }
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4 v = *reinterpret_cast<const uint4*>(xs + mega_sw<X>(base + 8 * w));
      xp[4 * w] = __byte_perm(v.x, v.z, 0x5410);
      xp[4 * w + 1] = __byte_perm(v.x, v.z, 0x7632);
      xp[4 * w + 2] = __byte_perm(v.y, v.w, 0x5410);
      xp[4 * w + 3] = __byte_perm(v.y, v.w, 0x7632);
    }
  }
}
template <typename T, typename X, int K, int RL, int RB, int UN, int GS, int KT>
__device__ __forceinline__ void mega_qdot4_mma(const unsigned int* const* rows, const T* const* sc,
                                               const T* const* bi, const X* xs, int koff, int lane,
                                               float* acc, unsigned long long pol) {
  constexpr int EPL = 32, IT = K / (32 * EPL), RP = (RL + 1) / 2;
  float c[RP][RB][4];
#pragma unroll
  for (int p = 0; p < RP; ++p)
#pragma unroll
    for (int b = 0; b < RB; ++b) c[p][b][0] = c[p][b][1] = c[p][b][2] = c[p][b][3] = 0.f;
#pragma unroll 1
  for (int i0 = 0; i0 < IT; i0 += UN) {
    uint4 wv[UN][RL];
    __nv_bfloat162 s[UN][RL], bb[UN][RL];
    mega_qload<__nv_bfloat162, T, UN, RL, IT, EPL, 8, GS>(rows, sc, bi, i0, lane, wv, s, bb, pol);
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      if (i0 + u >= IT) break;
      const int k0 = ((i0 + u) * 32 + lane) * EPL;
#pragma unroll
      for (int p = 0; p < RP; ++p) {
        // (an odd last row: A's rows g + 8 are zeros)
        const int r0 = 2 * p, r1 = 2 * p + 1 < RL ? 2 * p + 1 : 2 * p;
        const unsigned int* w0 = reinterpret_cast<const unsigned int*>(&wv[u][r0]);
        const unsigned int* w1 = reinterpret_cast<const unsigned int*>(&wv[u][r1]);
        unsigned int a0[16], a1[16];
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            a0[4 * w + j] = mega_deq2(w0[w] >> (4 * j), s[u][r0], bb[u][r0]);
            a1[4 * w + j] = r1 != r0 ? mega_deq2(w1[w] >> (4 * j), s[u][r1], bb[u][r1]) : 0u;
          }
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          unsigned int xp[16];
          mega_xpairs<X>(xs, b * KT + koff + k0, xp);
#pragma unroll
          for (int i = 0; i < 8; ++i)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(c[p][b][0]), "+f"(c[p][b][1]), "+f"(c[p][b][2]), "+f"(c[p][b][3])
                         : "r"(a0[2 * i]), "r"(a1[2 * i]), "r"(a0[2 * i + 1]), "r"(a1[2 * i + 1]),
                           "r"(xp[2 * i]), "r"(xp[2 * i + 1]));
        }
      }
    }
  }
  // the diagonal: lane (g, g / 2) holds D[g][g] (row 2p) and D[g + 8][g] (row 2p + 1)
  const int g = lane >> 2;
  const bool diag = (lane & 3) == (g >> 1);
#pragma unroll
  for (int r = 0; r < RL; ++r)
#pragma unroll
    for (int b = 0; b < RB; ++b)
      acc[r * RB + b] = mega_warp_sum(diag ? c[r / 2][b][2 * (r % 2) + (g & 1)] : 0.f);
}
// rows idx[0..RL) of a weight matrix of KT columns, its columns koff .. koff + K: float
// (QB 0: w is T*) or affine-quantized (QB bits: w packed words,
// s / b the group scales and biases; koff a multiple of the group size; whole dots only)
template <typename T, typename X, int K, int RL, int RB, int UN, int QB, int GS, int KT = K>
__device__ __forceinline__ void mega_mat_dot(const void* w, const T* s, const T* b, const int* idx,
                                             const X* xs, int lane, float* acc,
                                             unsigned long long pol, int koff = 0) {
  if constexpr (QB == 0) {
    const T* rows[RL];
#pragma unroll
    for (int r = 0; r < RL; ++r) rows[r] = reinterpret_cast<const T*>(w) + (size_t)idx[r] * KT + koff;
    mega_dot<T, X, K, RL, RB, UN, KT>(rows, xs, koff, lane, acc, pol);
  } else {
    const unsigned int* rows[RL];
    const T* sr[RL];
    const T* br[RL];
#pragma unroll
    for (int r = 0; r < RL; ++r) {
      rows[r] = reinterpret_cast<const unsigned int*>(w) + (size_t)idx[r] * (KT * QB / 32) + koff * QB / 32;
      sr[r] = s + (size_t)idx[r] * (KT / GS) + koff / GS;
      br[r] = b + (size_t)idx[r] * (KT / GS) + koff / GS;
    }
    if constexpr (QB == 4 && mega_same<T, __nv_bfloat16>::value)
      mega_qdot4_mma<T, X, K, RL, RB, UN, GS, KT>(rows, sr, br, xs, koff, lane, acc, pol);
    else
      mega_qdot<T, X, K, RL, RB, UN, QB, GS, KT>(rows, sr, br, xs, koff, lane, acc, pol);
  }
}
