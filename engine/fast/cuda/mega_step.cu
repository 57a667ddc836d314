// The decode step as one persistent kernel (engine.fast.mega): the body mx.fast.cuda_kernel
// wraps. Its parameters: the template arguments T (the model's dtype), RB (rows a call), ROW0
// (the call's first row) and FLOW (1 for a step of one row: see below), and the model's
// constants in namespace mlxp_mega with the
// per-layer pointer tables MEGA_TABLES (engine.fast.mega_cuda.config_header); its device
// functions in mega_device.cuh.
//
// Every block of THREADS threads (one block per SM, all resident at once) walks through the
// layers, and the blocks meet at a grid barrier (an atomic counter in the workspace) between
// the phases of a layer (between A and B only without FLOW: there, per-head flags; FLOW is the
// one-row step's, measured faster there; the batch lane's calls keep the barrier). A block
// arrives at a barrier with one release-add, and acquire/release atomics alone order the
// step's hand-offs (no fences besides); weight loads are marked evict-first in L2:
//
//   A  RMSNorm (as a scale) -> merged q/k/v rows -> RoPE; k and v written into the cache
//      at the position, q into the workspace          (a warp per rotation pair; mega_qkv.cu)
//   A2 (QKN: models with per-head q/k RMSNorm, qwen3) after one more barrier: phase A
//      leaves q and k unrotated in the workspace; each head is normalised, then rotated,
//      q back into the workspace, k into the cache    (a warp per head; mega_qkv.cu)
//   B  attention of each query head over a chunk of the cache: partial (max, sum, output);
//      the last warp of a head combines its chunks    (a warp per (head, chunk); mega_attn.cu)
//   C  o_proj + residual                              (a warp per hidden row)
//   D  RMSNorm -> merged gate/up rows -> SiLU(gate) * up   (a warp per pair of rows)
//   E  down_proj + residual                           (a warp per hidden row)
//
// and after the last layer the final RMSNorm and the output head (a warp per vocabulary
// row). Each block first loads the phase's input vector into shared memory (normalised in
// float where a norm precedes it), a thread's loads issued together; weights stream through
// `ld.global.nc.L1::no_allocate`, UN1 (paired rows: UN2) loads in flight per lane; values
// other blocks wrote during the step are read from L2 (`__ldcg`), never from a stale L1 line.
// The roundings are those of the fused GEMV kernels (gemv_main.cu): each projection's output
// rounded to the model's dtype, residual adds and SiLU·up rounded as the model's own
// operations round them. The KV caches are inputs written in place at the position (their
// arrays stay the cache: nothing is copied).
  using namespace mlxp_mega;
  // rows ROW0 .. ROW0 + RB - 1 of the batch; row b: token tok[ROW0 + b], RoPE position
  // rpos[ROW0 + b], keys and values written at column col[ROW0 + b] of cache row crow[ROW0 + b],
  // attention over columns [start[ROW0 + b], col[ROW0 + b]] of that row (the fast runner: col =
  // rpos, start 0; crow: the row's own slot; a verify's rows of one slot share it, each at its
  // own column: the grid barrier between phases A and B lets each see the others' keys)
  constexpr int WPB = THREADS / 32, CT = 32 * WPB;
  constexpr int QD = NQ * D, HALF = D / 2, DPL = D / 32;
  constexpr int NPAIR = (NQ + 2 * NKV) * HALF;
  constexpr int PSTR = D + 4;                      // a partial: D outputs, max, sum (16-byte rows)
  constexpr int VEC = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // a warp's place in the grid's units: block by block
  const int gw = (int)blockIdx.x * WPB + warp;
  const int NW = (int)gridDim.x * WPB;
  float* wsf = ws;
  unsigned int* ctr = reinterpret_cast<unsigned int*>(wsf);
  float* hbuf = wsf + 32;                          // [RB][H]
  float* qbuf = hbuf + RB * H;                     // [RB][QD]
  float* abuf = qbuf + RB * QD;                    // [RB][I]
  float* obuf = abuf + RB * I;                     // [RB][QD]
  unsigned int* hcnt = reinterpret_cast<unsigned int*>(obuf + RB * QD);   // [L][RB][NQ]
  float* part = obuf + RB * QD + (L * RB * NQ + 3) / 4 * 4;   // [RB][NQ][MAXCH][PSTR]
  float* kraw = part + (size_t)RB * NQ * MAXCH * PSTR;   // [RB][NKV * D] keys before their norm
  unsigned int* fcnt = reinterpret_cast<unsigned int*>(kraw + RB * QD);   // FLOW: [L][NQ + 2 NKV]
  // (room for NKV up to NQ) then, unused, the regions of variants since taken out of the kernel
  // (kept so that the workspace's layout, and the compiled kernel, stay as they were)
  constexpr int UNUSED = QD + (L * 5 + 1) * 8 + NQ * H + L * (H / 4) + L * NQ + L * 8 + H + 4 * L;
  unsigned int* prof = fcnt + (L * 3 * NQ + 3) / 4 * 4 + UNUSED;
  unsigned int* arrive = prof + 2 * (2 + 5 * L);   // PROF: [stamp][block] when it reached the barrier
  int nstamp = 0;
  extern __shared__ __align__(16) unsigned char xraw[];
  __shared__ float red[WPB][RB];
  __shared__ float sinv[RB];
  const unsigned long long pol = mega_policy();
  float* xf = reinterpret_cast<float*>(xraw);
  // the normalised inputs (phases A, D and the head) are float, and o_proj, down_proj and
  // the head take one weight row per warp (bf16 inputs, 2 or 4 rows: measured no faster)
  using XN = float;
  constexpr int R1 = 1;
  XN* xn = reinterpret_cast<XN*>(xraw);
  T* xt = reinterpret_cast<T*>(xraw);
  // where element i of a matrix input is stored: swizzled for quantized weights (mega_sw)
  auto swn = [](int i) { if constexpr (QB != 0) return mega_sw<XN>(i); else return i; };
  auto swt = [](int i) { if constexpr (QB != 0) return mega_sw<T>(i); else return i; };
  const float NEG_INF = -__int_as_float(0x7f800000);
  const float eps = EPS_NUM / 1e12f;
  const float scale = SCALE_NUM / 1e9f;
  const int CAP = k_0_shape[2];
  // row b writes at column col[ROW0 + b] and attends up to it: the call's longest row sets the
  // chunking (a shorter row's chunks past its end are empty)
  int amax = 1;
#pragma unroll
  for (int b = 0; b < RB; ++b) amax = max(amax, col[ROW0 + b] + 1 - L3_FAULT_DROP);
  // chunks of CS = 32 * k columns, at most MAXCH of them per (row, head)
  const int cs = 32 * max(1, (amax + 32 * MAXCH - 1) / (32 * MAXCH));
  const int nch = (amax + cs - 1) / cs;
  // FLOW (one-row calls of models without q/k norms): phase B starts per head, not after a barrier
  constexpr bool flow = FLOW != 0 && QKN == 0;
  __shared__ __align__(16) float qslot[WPB][D];    // FLOW: a warp's query head
  unsigned int target = 0;
  // PROF: block 0 stamps the global timer (ns) as each phase ends (after its barrier)
#define MEGA_STAMP() do { if (PROF && blockIdx.x == 0 && threadIdx.x == 0) { \
    unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \
    prof[2 * nstamp] = (unsigned int)t_; prof[2 * nstamp + 1] = (unsigned int)(t_ >> 32); } ++nstamp; } while (0)
  // PROF: each block stamps when all its warps are done with the phase (before the barrier)
#define MEGA_ARRIVE() do { if (PROF) { MEGA_SYNC(); if (threadIdx.x == 0) { \
    const unsigned long long t_ = mega_now(); const size_t i_ = 2 * ((size_t)nstamp * gridDim.x + blockIdx.x); \
    arrive[i_] = (unsigned int)t_; arrive[i_ + 1] = (unsigned int)(t_ >> 32); } } } while (0)
  // the end of a phase: every block's arrival (PROF), the grid barrier, block 0's stamp (PROF)
#define MEGA_BARRIER() do { MEGA_ARRIVE(); \
    mega_grid_sync(ctr, target); MEGA_STAMP(); } while (0)
  // before a barrier: the warp's first unit of the next phase (RL rows of K elements,
  // rows n and n + OFF) prefetched into L2, so its weights stream while blocks wait
#define MEGA_PREFETCH(Wp, KK, NUNITS, RL_, OFF, ROW0_) do { if (gw < (NUNITS)) { \
    const int cap_ = (KK) * WBITS / 8; \
    for (int r_ = 0; r_ < (RL_); ++r_) { \
      const char* b_ = reinterpret_cast<const char*>(Wp) + (size_t)((ROW0_) + gw + r_ * (OFF)) * (KK) * WBITS / 8; \
      for (int o_ = lane * 128; o_ < cap_; o_ += 32 * 128) \
        asm volatile("prefetch.global.L2 [%0];" :: "l"(b_ + o_)); } } } while (0)
  MEGA_STAMP();
  MEGA_TABLES
  constexpr int WBITS = QB ? QB : 8 * (int)sizeof(T);     // bits a weight element takes
  // element k of the embedding row of token t (dequantized as MLX does, to T)
  auto emb_at = [&](int t, int k) -> float {
    if constexpr (QB == 0) {
      return static_cast<float>(reinterpret_cast<const T*>(emb)[(size_t)t * H + k]);
    } else {
      constexpr int PW = 32 / (QB ? QB : 32);
      const unsigned int wd = reinterpret_cast<const unsigned int*>(emb)[((size_t)t * H + k) / PW];
      const float q = static_cast<float>((wd >> (QB * (k % PW))) & ((1u << QB) - 1u));
      const size_t g = (size_t)t * (H / GS) + k / GS;
      return static_cast<float>(T(static_cast<float>(EMB_S[g]) * q + static_cast<float>(EMB_B[g])));
    }
  };
  // each row's x (hbuf, or its embedding row for the first layer) RMS-normalised into xf
  // as sum-scale: xf[b] = x[b] * w; sinv[b] = rsqrt(mean(x[b]^2) + eps)
  // (a thread's loads of a row issued together before any is used)
  // (hin: where x is, hbuf unless said)
  auto load_normed = [&](const T* nw, bool first, const float* hin) {
    float s[RB];
#pragma unroll
    for (int b = 0; b < RB; ++b) s[b] = 0.f;
    constexpr int PT = (H + CT - 1) / CT;   // elements a thread takes
    // (loads unconditional, past the end clamped to the last element)
    float w[PT];
#pragma unroll
    for (int j = 0; j < PT; ++j) w[j] = static_cast<float>(nw[min(threadIdx.x + j * CT, H - 1)]);
#pragma unroll
    for (int b = 0; b < RB; ++b) {
      const int t = first ? tok[ROW0 + b] : 0;
      float v[PT];
#pragma unroll
      for (int j = 0; j < PT; ++j) {
        const int k = min(threadIdx.x + j * CT, H - 1);
        v[j] = first ? emb_at(t, k) : __ldcg(hin + b * H + k);
      }
#pragma unroll
      for (int j = 0; j < PT; ++j) {
        const int k = threadIdx.x + j * CT;
        if (k < H) {
          if (first && blockIdx.x == 0) hbuf[b * H + k] = v[j];
          s[b] += v[j] * v[j];
          xn[swn(b * H + k)] = XN(v[j] * w[j]);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < RB; ++b) {
      s[b] = mega_warp_sum(s[b]);
      if (lane == 0) red[warp][b] = s[b];
    }
    MEGA_SYNC();
    if (threadIdx.x < RB) {
      float tot = 0.f;
#pragma unroll
      for (int w = 0; w < WPB; ++w) tot += red[w][threadIdx.x];
      sinv[threadIdx.x] = rsqrtf(tot / H + eps);
    }
    MEGA_SYNC();
  };

  // o_proj and down_proj: hbuf[b] += T(W . xt[b]) with the residual add rounded as the
  // model rounds it; a warp per R1 hidden rows (R1 is 1: a unit is a row); KK (a mega_int)
  // the matrix's columns, UNP (a mega_int) the loads in flight
  auto proj_residual = [&](auto kk, auto un, const void* w, const T* ws_, const T* wb_) {
    constexpr int KK = decltype(kk)::value, UNP = decltype(un)::value;
    static_assert(R1 == 1, "a unit is one row");
    for (int n0 = gw; n0 < H; n0 += NW) {
      int idx[R1];
#pragma unroll
      for (int r = 0; r < R1; ++r) idx[r] = min(n0 + r, H - 1);
      float acc[R1 * RB], hres = 0.f;
      // the residual this lane adds to, asked for before the dot so its latency is hidden
      if (lane < R1 * RB && n0 + lane / RB < H) hres = __ldcg(hbuf + (lane % RB) * H + n0 + lane / RB);
      mega_mat_dot<T, T, KK, R1, RB, UNP, QB, GS>(w, ws_, wb_, idx, xt, lane, acc, pol);
#pragma unroll
      for (int r = 0; r < R1; ++r)
#pragma unroll
        for (int b = 0; b < RB; ++b)
          if (lane == r * RB + b && n0 + r < H)
            hbuf[b * H + n0 + r] = static_cast<float>(T(hres + static_cast<float>(T(acc[r * RB + b]))));
    }
  };

  for (int l = 0; l < L; ++l) {
#include "mega_qkv.cu"
    MEGA_ARRIVE();
    if constexpr (!flow) mega_grid_sync(ctr, target);
    MEGA_STAMP();
#include "mega_attn.cu"
    MEGA_BARRIER();
    // --- C: o_proj + residual (a warp per hidden row)
    {
      mega_stage<T, RB * QD, CT>(obuf, xt, swt);
      MEGA_SYNC();
      proj_residual(mega_int<QD>{}, mega_int<UNO>{}, WO[l], WO_S[l], WO_B[l]);
      MEGA_PREFETCH(WGU[l], H, I, 2, I, 0);
    }
    // --- D: norm -> gate/up -> SiLU(gate) * up (a warp per pair of rows)
    MEGA_BARRIER();
    load_normed(LN2[l], false, hbuf);
    {
      for (int n = gw; n < I; n += NW) {
        const int idx[2] = {n, I + n};
        float acc[2 * RB];
        mega_mat_dot<T, XN, H, 2, RB, UN2, QB, GS>(WGU[l], WGU_S[l], WGU_B[l], idx, xn, lane, acc, pol);
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          if (lane != b) continue;
          const float g = static_cast<float>(T(acc[b] * sinv[b]));
          const float up = static_cast<float>(T(acc[RB + b] * sinv[b]));
          const float s = static_cast<float>(T(g / (1.f + __expf(-g))));
          abuf[b * I + n] = static_cast<float>(T(s * up));
        }
      }
      MEGA_PREFETCH(WD[l], I, (H + R1 - 1) / R1, R1, 1, gw * (R1 - 1));
    }
    // --- E: down_proj + residual (a warp per hidden row)
    MEGA_BARRIER();
    {
      mega_stage<T, RB * I, CT>(abuf, xt, swt);
      MEGA_SYNC();
      proj_residual(mega_int<I>{}, mega_int<UN1>{}, WD[l], WD_S[l], WD_B[l]);
    }
    if (l + 1 < L && gw < NPAIR) {      // the next layer's first q/k/v pair
      const int u = flow ? (gw + NQ * HALF) % NPAIR : gw;   // (FLOW: keys and values first)
      MEGA_PREFETCH(WQKV[l + 1], H, NPAIR, 2, HALF, (u / HALF) * D + u % HALF - gw);
    } else if (l + 1 == L) {
      MEGA_PREFETCH(headw, H, (V + R1 - 1) / R1, R1, 1, gw * (R1 - 1));
    }
    MEGA_BARRIER();
  }
  // --- the final norm and the output head (a warp per vocabulary row)
  {
    load_normed(fnorm, L == 0, hbuf);
    for (int n0 = gw; n0 < V; n0 += NW) {
      int idx[R1];
#pragma unroll
      for (int r = 0; r < R1; ++r) idx[r] = min(n0 + r, V - 1);
      float acc[R1 * RB];
      mega_mat_dot<T, XN, H, R1, RB, UN1, QB, GS>(headw, HEAD_S, HEAD_B, idx, xn, lane, acc, pol);
#pragma unroll
      for (int r = 0; r < R1; ++r)
#pragma unroll
        for (int b = 0; b < RB; ++b)
          if (lane == r * RB + b && n0 + r < V) logits[(size_t)b * V + n0 + r] = T(acc[r * RB + b] * sinv[b]);
    }
  }
  if (PROF) {                                      // the head's end: after every block is done
    MEGA_ARRIVE();
    if (threadIdx.x == 0) { __threadfence(); atomicAdd(ctr, 1u); }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      mega_wait_at_least(ctr, target + gridDim.x);
      unsigned long long t_;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));
      prof[2 * nstamp] = (unsigned int)t_; prof[2 * nstamp + 1] = (unsigned int)(t_ >> 32);
    }
  }
