"""CUDA source of the one-kernel decode step (engine.fast.mega).

One persistent kernel runs a whole decode step of a llama-family model for one sequence:
every block of THREADS threads (one block per SM, all resident at once) walks through the
layers, and the blocks meet at a grid barrier (an atomic counter in the workspace) between
the phases of a layer:

  A  RMSNorm (as a scale) -> merged q/k/v rows -> RoPE; k and v written into the cache
     at the position, q into the workspace          (a warp per rotation pair)
  B  attention of each query head over a chunk of the cache: partial (max, sum, output)
                                                    (a warp per (head, chunk))
  C  the chunks combined (every block, into shared memory) -> o_proj + residual
                                                    (a warp per hidden row)
  D  RMSNorm -> merged gate/up rows -> SiLU(gate) * up   (a warp per pair of rows)
  E  down_proj + residual                           (a warp per hidden row)

and after the last layer the final RMSNorm and the output head (a warp per vocabulary
row). Each block first loads the phase's input vector into shared memory (normalised in
float where a norm precedes it); weights stream through `ld.global.nc.L1::no_allocate`,
8 loads in flight per lane; values other blocks wrote during the step are read from L2
(`__ldcg`), never from a stale L1 line. The roundings are those of the fused GEMV
kernels (engine.fast.gemv_cuda): each projection's output rounded to the model's dtype,
residual adds and SiLU·up rounded as the model's own operations round them.

The KV caches are inputs written in place at the position (their arrays stay the cache:
nothing is copied). The tables of per-layer pointers are generated for the model's layer
count (`source(L)`).
"""

from __future__ import annotations

THREADS = 512
WPB = THREADS // 32
MAXCH = 64          # chunks of the cache per query head in phase B (at most)

HEADER = r"""
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(512, 1)

__device__ __forceinline__ unsigned int mega_ld_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// all blocks meet here; `target` counts the arrivals every block waits for
__device__ __forceinline__ void mega_grid_sync(unsigned int* ctr, unsigned int& target) {
  __syncthreads();
  target += gridDim.x;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ctr, 1u);
    while (mega_ld_acquire(ctr) < target) { }
    __threadfence();
  }
  __syncthreads();
}
__device__ __forceinline__ uint4 mega_ld_w(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
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
// RL weight rows of K elements dotted with xs (shared memory, float or T); every lane
// ends with the sums. K is a multiple of 32 * VEC.
template <typename T, typename X, int K, int RL, int UN>
__device__ __forceinline__ void mega_dot(const T* const* rows, const X* xs, int lane, float* acc) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int IT = K / (32 * VEC);
#pragma unroll
  for (int r = 0; r < RL; ++r) acc[r] = 0.f;
#pragma unroll 1
  for (int i0 = 0; i0 < IT; i0 += UN) {
    uint4 wv[UN][RL];
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      if (i0 + u < IT) {
#pragma unroll
        for (int r = 0; r < RL; ++r) wv[u][r] = mega_ld_w(rows[r] + ((i0 + u) * 32 + lane) * VEC);
      }
    }
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      if (i0 + u >= IT) break;
      const int k = ((i0 + u) * 32 + lane) * VEC;
      float xv[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) xv[j] = static_cast<float>(xs[k + j]);
#pragma unroll
      for (int r = 0; r < RL; ++r) {
        const T* we = reinterpret_cast<const T*>(&wv[u][r]);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[r] += static_cast<float>(we[j]) * xv[j];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RL; ++r) acc[r] = mega_warp_sum(acc[r]);
}
"""

BODY = r"""
  constexpr int WPB = THREADS / 32;
  constexpr int QD = NQ * D, HALF = D / 2, DPL = D / 32;
  constexpr int NPAIR = (NQ + 2 * NKV) * HALF;
  constexpr int PSTR = D + 2;
  constexpr int VEC = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gw = (int)blockIdx.x * WPB + warp, NW = (int)gridDim.x * WPB;
  float* wsf = ws;
  unsigned int* ctr = reinterpret_cast<unsigned int*>(wsf);
  float* hbuf = wsf + 32;
  float* qbuf = hbuf + H;
  float* abuf = qbuf + QD;
  float* obuf = abuf + I;
  unsigned int* hcnt = reinterpret_cast<unsigned int*>(obuf + QD);   // [L][NQ] chunk counters
  float* part = obuf + QD + L * NQ;
  unsigned int* prof = reinterpret_cast<unsigned int*>(part + (size_t)NQ * MAXCH * PSTR);
  int nstamp = 0;
  __shared__ __align__(16) unsigned char xraw[XBYTES];
  __shared__ float red[WPB];
  float* xf = reinterpret_cast<float*>(xraw);
  T* xt = reinterpret_cast<T*>(xraw);
  const float NEG_INF = -__int_as_float(0x7f800000);
  const float eps = EPS_NUM / 1e12f;
  const float scale = SCALE_NUM / 1e9f;
  const int p = pos[0];
  const int CAP = k_0_shape[2];
  const int alen = (p + 1) - DROP;                 // positions attended
  // chunks of CS = 32 * k positions, at most MAXCH of them per head
  const int cs = 32 * max(1, (max(alen, 1) + 32 * MAXCH - 1) / (32 * MAXCH));
  const int nch = (max(alen, 1) + cs - 1) / cs;
  unsigned int target = 0;
  // PROF: block 0 stamps the global timer (ns) as each phase ends (after its barrier)
#define MEGA_STAMP() do { if (PROF && blockIdx.x == 0 && threadIdx.x == 0) { \
    unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \
    prof[2 * nstamp] = (unsigned int)t_; prof[2 * nstamp + 1] = (unsigned int)(t_ >> 32); } ++nstamp; } while (0)
  // before a barrier: the warp's first unit of the next phase (RL rows of K elements,
  // rows n and n + OFF) prefetched into L2, so its weights stream while blocks wait
#define MEGA_PREFETCH(Wp, KK, NUNITS, RL_, OFF) do { if (gw < (NUNITS)) { \
    for (int r_ = 0; r_ < (RL_); ++r_) { \
      const char* b_ = reinterpret_cast<const char*>((Wp) + (size_t)(gw + r_ * (OFF)) * (KK)); \
      for (int o_ = lane * 128; o_ < (KK) * (int)sizeof(T); o_ += 32 * 128) \
        asm volatile("prefetch.global.L2 [%0];" :: "l"(b_ + o_)); } } } while (0)
  MEGA_STAMP();
__TABLES__
  // x (hbuf, or the embedding row for the first layer) RMS-normalised into xf as
  // sum-scale: xf = x * w, returns rsqrt(mean(x^2) + eps)
  auto load_normed = [&](const T* nw, bool first) -> float {
    float s = 0.f;
    const T* erow = emb + (size_t)tok[0] * H;
    for (int k = threadIdx.x; k < H; k += THREADS) {
      const float v = first ? static_cast<float>(erow[k]) : __ldcg(hbuf + k);
      if (first && blockIdx.x == 0) hbuf[k] = v;
      s += v * v;
      xf[k] = v * static_cast<float>(nw[k]);
    }
    s = mega_warp_sum(s);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < WPB; ++w) tot += red[w];
    __syncthreads();
    return rsqrtf(tot / H + eps);
  };

  for (int l = 0; l < L; ++l) {
    // --- A: norm -> q/k/v -> RoPE, k/v into the cache
    {
      const float inv = load_normed(LN1[l], l == 0);
      const T* w = WQKV[l];
      for (int u = gw; u < NPAIR; u += NW) {
        const int head = u / HALF, i = u % HALF, r1 = head * D + i;
        const T* rows[2] = {w + (size_t)r1 * H, w + (size_t)(r1 + HALF) * H};
        float acc[2];
        mega_dot<T, float, H, 2, UN2>(rows, xf, lane, acc);
        if (lane == 0) {
          const float x1 = static_cast<float>(T(acc[0] * inv));
          const float x2 = static_cast<float>(T(acc[1] * inv));
          if (head < NQ + NKV) {
            const float theta = static_cast<float>(p + SHIFT) * inv_freq[i];
            float sn, c;
            sincosf(theta, &sn, &c);
            const T y1 = T(x1 * c - x2 * sn), y2 = T(x1 * sn + x2 * c);
            if (head < NQ) {
              qbuf[head * D + i] = static_cast<float>(y1);
              qbuf[head * D + i + HALF] = static_cast<float>(y2);
            } else {
              T* kc = KC[l] + ((size_t)(head - NQ) * CAP + p) * D;
              kc[i] = y1;
              kc[i + HALF] = y2;
            }
          } else {
            T* vc = VC[l] + ((size_t)(head - NQ - NKV) * CAP + p) * D;
            vc[i] = T(x1);
            vc[i + HALF] = T(x2);
          }
        }
      }
    }
    mega_grid_sync(ctr, target);
    MEGA_STAMP();
    // --- B: attention, a warp per (query head, chunk of CS positions): lane j scores
    // position j of each 32 (its key row read whole), then the lanes own DPL of the D
    // output dims and add up p_j * v_j over the 32 positions (all 32 value loads issued
    // at once); a chunk's partial (max, sum, output) goes to the workspace, and the last
    // warp to finish a head's chunks (a counter per head) combines them into obuf.
    {
      for (int k = threadIdx.x; k < QD; k += THREADS) xf[k] = __ldcg(qbuf + k);
      __syncthreads();
      const T* kcache = KC[l];
      const T* vcache = VC[l];
      for (int u = gw; u < NQ * nch; u += NW) {
        const int hq = u / nch, c = u % nch, g = hq / (NQ / NKV);
        const T* kb = kcache + (size_t)g * CAP * D;
        const T* vb = vcache + (size_t)g * CAP * D;
        const int start = c * cs, end = min(alen, start + cs);
        const float* qh = xf + hq * D;
        float m = NEG_INF, lsum = 0.f, o[DPL];
#pragma unroll
        for (int d = 0; d < DPL; ++d) o[d] = 0.f;
        for (int p0 = start; p0 < end; p0 += 32) {
          const int pp = p0 + lane;
          float sc = NEG_INF;
          if (pp < end) {
            const T* kr = kb + (size_t)pp * D;
            uint4 kv[D / VEC];
#pragma unroll
            for (int v = 0; v < D / VEC; ++v) kv[v] = __ldcg(reinterpret_cast<const uint4*>(kr + v * VEC));
            float dot = 0.f;
#pragma unroll
            for (int v = 0; v < D / VEC; ++v) {
              const T* ke = reinterpret_cast<const T*>(&kv[v]);
#pragma unroll
              for (int j = 0; j < VEC; ++j) dot += qh[v * VEC + j] * static_cast<float>(ke[j]);
            }
            sc = dot * scale;
          }
          const float mn = fmaxf(m, mega_warp_max(sc));
          const float pj = pp < end ? __expf(sc - mn) : 0.f;
          const float corr = __expf(m - mn);
          lsum = lsum * corr + mega_warp_sum(pj);
#pragma unroll
          for (int d = 0; d < DPL; ++d) o[d] *= corr;
          // the values for this lane's dims, VB positions' loads issued before they are used
          constexpr int VB = DPL <= 2 ? 32 : 16;
#pragma unroll
          for (int j0 = 0; j0 < 32; j0 += VB) {
            float vv[VB][DPL];
#pragma unroll
            for (int j = 0; j < VB; ++j) {
              const T* vr = vb + (size_t)min(p0 + j0 + j, end - 1) * D + lane * DPL;
#pragma unroll
              for (int d = 0; d < DPL; ++d) vv[j][d] = mega_ldcg_t(vr + d);
            }
#pragma unroll
            for (int j = 0; j < VB; ++j) {
              const float pjj = __shfl_sync(0xffffffffu, pj, j0 + j);
#pragma unroll
              for (int d = 0; d < DPL; ++d) o[d] += pjj * vv[j][d];
            }
          }
          m = mn;
        }
        float* pr = part + ((size_t)hq * MAXCH + c) * PSTR;
#pragma unroll
        for (int d = 0; d < DPL; ++d) pr[lane * DPL + d] = o[d];
        if (lane == 0) { pr[D] = m; pr[D + 1] = lsum; }
        __threadfence();
        unsigned int done = 0;
        if (lane == 0) done = atomicAdd(hcnt + l * NQ + hq, 1u);
        done = __shfl_sync(0xffffffffu, done, 0);
        if (done == (unsigned int)(nch - 1)) {        // the head's last chunk: combine
          __threadfence();
          float M = NEG_INF;
          for (int cc = 0; cc < nch; ++cc) M = fmaxf(M, __ldcg(part + ((size_t)hq * MAXCH + cc) * PSTR + D));
          float ls = 0.f, acc[DPL];
#pragma unroll
          for (int d = 0; d < DPL; ++d) acc[d] = 0.f;
          for (int cc = 0; cc < nch; ++cc) {
            const float* q2 = part + ((size_t)hq * MAXCH + cc) * PSTR;
            const float mc = __ldcg(q2 + D);
            const float wgt = mc == NEG_INF ? 0.f : __expf(mc - M);
            ls += wgt * __ldcg(q2 + D + 1);
#pragma unroll
            for (int d = 0; d < DPL; ++d) acc[d] += wgt * __ldcg(q2 + lane * DPL + d);
          }
#pragma unroll
          for (int d = 0; d < DPL; ++d)
            obuf[hq * D + lane * DPL + d] = static_cast<float>(T(ls > 0.f ? acc[d] / ls : 0.f));
        }
      }
      MEGA_PREFETCH(WO[l], QD, H, 1, 0);
    }
    mega_grid_sync(ctr, target);
    MEGA_STAMP();
    // --- C: o_proj + residual
    {
      for (int k = threadIdx.x; k < QD; k += THREADS) xt[k] = T(__ldcg(obuf + k));
      __syncthreads();
      const T* w = WO[l];
      for (int n = gw; n < H; n += NW) {
        const T* rows[1] = {w + (size_t)n * QD};
        float acc[1];
        mega_dot<T, T, QD, 1, UN1>(rows, xt, lane, acc);
        if (lane == 0) hbuf[n] = static_cast<float>(T(__ldcg(hbuf + n) + static_cast<float>(T(acc[0]))));
      }
      MEGA_PREFETCH(WGU[l], H, I, 2, I);
    }
    mega_grid_sync(ctr, target);
    MEGA_STAMP();
    // --- D: norm -> gate/up -> SiLU(gate) * up
    {
      const float inv = load_normed(LN2[l], false);
      const T* w = WGU[l];
      for (int n = gw; n < I; n += NW) {
        const T* rows[2] = {w + (size_t)n * H, w + (size_t)(I + n) * H};
        float acc[2];
        mega_dot<T, float, H, 2, UN2>(rows, xf, lane, acc);
        if (lane == 0) {
          const float g = static_cast<float>(T(acc[0] * inv));
          const float up = static_cast<float>(T(acc[1] * inv));
          const float s = static_cast<float>(T(g / (1.f + __expf(-g))));
          abuf[n] = static_cast<float>(T(s * up));
        }
      }
      MEGA_PREFETCH(WD[l], I, H, 1, 0);
    }
    mega_grid_sync(ctr, target);
    MEGA_STAMP();
    // --- E: down_proj + residual
    {
      for (int k = threadIdx.x; k < I; k += THREADS) xt[k] = T(__ldcg(abuf + k));
      __syncthreads();
      const T* w = WD[l];
      for (int n = gw; n < H; n += NW) {
        const T* rows[1] = {w + (size_t)n * I};
        float acc[1];
        mega_dot<T, T, I, 1, UN1>(rows, xt, lane, acc);
        if (lane == 0) hbuf[n] = static_cast<float>(T(__ldcg(hbuf + n) + static_cast<float>(T(acc[0]))));
      }
      if (l + 1 < L && gw < NPAIR) {      // the next layer's first q/k/v pair
        const int r1 = (gw / HALF) * D + gw % HALF;
        MEGA_PREFETCH(WQKV[l + 1] + (size_t)(r1 - gw) * H, H, NPAIR, 2, HALF);
      } else if (l + 1 == L) {
        MEGA_PREFETCH(headw, H, V, 1, 0);
      }
    }
    mega_grid_sync(ctr, target);
    MEGA_STAMP();
  }
  // --- the final norm and the output head
  {
    const float inv = load_normed(fnorm, L == 0);
    for (int n = gw; n < V; n += NW) {
      const T* rows[1] = {headw + (size_t)n * H};
      float acc[1];
      mega_dot<T, float, H, 1, UN1>(rows, xf, lane, acc);
      if (lane == 0) logits[n] = T(acc[0] * inv);
    }
  }
  if (PROF) {                                      // the head's end: after every block is done
    __syncthreads();
    if (threadIdx.x == 0) { __threadfence(); atomicAdd(ctr, 1u); }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      while (mega_ld_acquire(ctr) < target + gridDim.x) { }
      unsigned long long t_;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));
      prof[2 * nstamp] = (unsigned int)t_; prof[2 * nstamp + 1] = (unsigned int)(t_ >> 32);
    }
  }
"""

PER_LAYER = ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")


def input_names(n_layers: int) -> list:
    """The kernel's inputs, in order: the step's scalars and shared weights, then per
    layer its norms and projections, then the key and value caches."""
    names = ["tok", "pos", "emb", "inv_freq", "fnorm", "headw"]
    for i in range(n_layers):
        names += [f"{k}_{i}" for k in PER_LAYER]
    names += [f"k_{i}" for i in range(n_layers)] + [f"v_{i}" for i in range(n_layers)]
    return names


def source(n_layers: int) -> str:
    """BODY with the per-layer pointer tables for n_layers layers."""
    def table(name, key, writable=False):
        items = ", ".join((f"const_cast<T*>({key}_{i})" if writable else f"{key}_{i}")
                          for i in range(n_layers))
        return f"  {'T*' if writable else 'const T*'} {name}[{n_layers}] = {{{items}}};\n"
    tables = (table("LN1", "ln1") + table("WQKV", "wqkv") + table("WO", "wo") + table("LN2", "ln2")
              + table("WGU", "wgu") + table("WD", "wd") + table("KC", "k", True) + table("VC", "v", True))
    return BODY.replace("__TABLES__\n", tables)


def workspace_floats(H: int, n_heads: int, head_dim: int, inter: int, n_layers: int) -> int:
    """Floats of the workspace: barrier counter (32), h, q, SiLU·up output, attention
    output, per-layer chunk counters, attention partials, then the PROF stamps."""
    return (32 + H + 2 * n_heads * head_dim + inter + n_layers * n_heads
            + n_heads * MAXCH * (head_dim + 2) + 2 * n_stamps(n_layers))


def n_stamps(n_layers: int) -> int:
    """PROF time stamps: the start, the end of each of a layer's 5 phases, the head's end."""
    return 2 + 5 * n_layers


def shared_bytes(H: int, n_heads: int, head_dim: int, inter: int, itemsize: int) -> int:
    """Static shared memory for the phase inputs (the largest of them)."""
    return max(4 * H, 4 * n_heads * head_dim, itemsize * inter)
