"""CUDA source of the one-kernel decode step (engine.fast.mega).

One persistent kernel runs a whole decode step of a llama-family model for one sequence:
every block of THREADS threads (one block per SM, all resident at once) walks through the
layers, and the blocks meet at a grid barrier (an atomic counter in the workspace) between
the phases of a layer (between A and B only without FLOW: there, per-head flags):

  A  RMSNorm (as a scale) -> merged q/k/v rows -> RoPE; k and v written into the cache
     at the position, q into the workspace          (a warp per rotation pair; mega_qkv)
  A2 (QKN: models with per-head q/k RMSNorm, qwen3) after one more barrier: phase A
     leaves q and k unrotated in the workspace; each head is normalised, then rotated,
     q back into the workspace, k into the cache    (a warp per head; mega_qkv)
  B  attention of each query head over a chunk of the cache: partial (max, sum, output);
     the last warp of a head combines its chunks    (a warp per (head, chunk); mega_attn)
  C  o_proj + residual                              (a warp per hidden row)
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

from . import mega_attn as A
from . import mega_bal as B
from . import mega_chd as CH
from . import mega_layout as L_
from . import mega_ogrp as O
from . import mega_prod as P
from . import mega_qkv as Q
from . import mega_device as D

THREADS = 512
# (mega_layout.WPB is THREADS // 32)
WPB = L_.WPB
MAXCH, PRE_LOADS, PRE_BYTES = L_.MAXCH, L_.PRE_LOADS, L_.PRE_BYTES
# the workspace's and shared memory's sizes (engine.fast.mega_layout)
workspace_floats, n_stamps, input_bytes = L_.workspace_floats, L_.n_stamps, L_.input_bytes
pre_region, shared_bytes, rows_per_call = L_.pre_region, L_.shared_bytes, L_.rows_per_call
SHARED_MAX, MAX_ROWS = L_.SHARED_MAX, L_.MAX_ROWS
static_bytes, launch_shared = L_.static_bytes, L_.launch_shared

HEADER = D.HEADER     # the device functions (engine.fast.mega_device)


BODY = r"""
  // rows ROW0 .. ROW0 + RB - 1 of the batch; row b: token tok[ROW0 + b], RoPE position
  // rpos[ROW0 + b], keys and values written at column col[0] of cache row ROW0 + b,
  // attention over columns [start[ROW0 + b], col[0]] (the solo step: one row, start 0)
  // (PROD: the last warp streams weights into L2 (engine.fast.mega_prod): WPB warps and CT
  // threads of a block compute)
  constexpr int WPB = THREADS / 32 - (PROD > 0 ? 1 : 0), CT = 32 * WPB;
  constexpr int QD = NQ * D, HALF = D / 2, DPL = D / 32;
  constexpr int NPAIR = (NQ + 2 * NKV) * HALF;
  constexpr int PSTR = D + 4;                      // a partial: D outputs, max, sum (16-byte rows)
  constexpr int VEC = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned int OPT = (unsigned int)opt[0];
  // a warp's place in the grid's units: block by block, or (SPREAD) across the blocks first,
  // so that a phase with fewer units than warps keeps every SM busy
  const int gw = (OPT & MEGA_OPT_SPREAD) ? warp * (int)gridDim.x + (int)blockIdx.x
                                         : (int)blockIdx.x * WPB + warp;
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
  unsigned int* pcnt = fcnt + (L * 3 * NQ + 3) / 4 * 4;    // (room for NKV up to NQ)
  // QROW: [NQ + NKV][HALF] rows of each q/k rotation pair done, over the layers
  unsigned int* dctr = pcnt + QD;                  // DYN: [L * 5 + 1][8] units handed out
  // OGRP: o_proj's partial sums [NKV][H], its row blocks' counters [L][H / ORO], each group's
  // heads combined [L][NKV], the units handed out [L][8]
  constexpr int ORO = 4;                           // (OGRP: rows a unit takes)
  float* opart = reinterpret_cast<float*>(dctr + (L * 5 + 1) * 8);
  unsigned int* rcnt = reinterpret_cast<unsigned int*>(opart + NQ * H);
  unsigned int* gdone = rcnt + L * (H / ORO);
  unsigned int* octr = gdone + L * NQ;             // [L][8]
  float* hbuf2 = reinterpret_cast<float*>(octr + L * 8);   // [H]: h after o_proj (apart from the
  // h that blocks still in phase A may be reading)
  unsigned int* dcnt = reinterpret_cast<unsigned int*>(hbuf2 + H);   // CHD: [L][4] (mega_chd)
  unsigned int* prof = dcnt + 4 * L;
  unsigned int* arrive = prof + 2 * (2 + 5 * L);   // PROF: [stamp][block] when it reached the barrier
  int nstamp = 0;
  extern __shared__ __align__(16) unsigned char xraw[];
  __shared__ float red[WPB][RB];
  __shared__ float sinv[RB];
  __shared__ float part2[WPB / 2][2 * RB];       // phase A with QSPLIT: the second halves' sums
  const unsigned long long pol = mega_policy(OPT & MEGA_OPT_EVF);
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
  const int wcol = col[0];
  const int CAP = k_0_shape[2];
  const int aend = wcol + 1 - DROP;                // columns attended end here (exclusive)
  // chunks of CS = 32 * k columns, at most MAXCH of them per (row, head)
  const int cs = 32 * max(1, (max(aend, 1) + 32 * MAXCH - 1) / (32 * MAXCH));
  const int nch = (max(aend, 1) + cs - 1) / cs;
  // FLOW (models without q/k norms): phase B starts per head, not after a barrier
  const bool flow = (OPT & MEGA_OPT_FLOW) && QKN == 0;
  // QROW (MLXP_MEGA_QROW=1, a compile-time choice: its registers would stay in the default
  // kernel): phase A takes a warp per q/k/v row, not per rotation pair, where that takes fewer
  // rounds of loads (more pairs than warps: the 8B shapes); FLOW's value flags then count rows
  constexpr int NROW = 2 * NPAIR;
  const bool qrow = QROW != 0 && (NROW + NW - 1) / NW < 2 * ((NPAIR + NW - 1) / NW);
__DYN__
  __shared__ __align__(16) float qslot[WPB][D];    // FLOW: a warp's query head
  // PRE (float weights, one row, a shared memory region PRESM for it): a warp's first loads of
  // the next phase copied into its PRE_LOADS x 32 16-byte slots before the barrier (cp.async);
  // PRE 2: two slots, and while a unit runs the first loads of the warp's next unit are copied
  // into the other one
  // (the phase inputs' bytes: engine.fast.mega_cuda.input_bytes)
  constexpr int XBYTES = (RB * mega_cmax(mega_cmax(4 * H, 4 * QD), (int)sizeof(T) * I) + 15) / 16 * 16;
  // OGRP (MLXP_MEGA_OGRP=1, a compile-time choice; with FLOW, one row, float weights; each warp's
  // copy of a group's outputs in ogx): engine.fast.mega_ogrp
  const bool ogrp = OGRP != 0 && RB == 1 && QB == 0 && H % ORO == 0 && flow;
  __shared__ __align__(16) T ogx[OGRP != 0 && RB == 1 ? WPB * QD / NKV : 8];   // (OGRP: a group per warp)
  // (a compile-time choice, MLXP_MEGA_PRE: without it, none of this is in the kernel)
  constexpr bool preon = (PRE == 1 || PRE == 2) && PRESM != 0 && QB == 0 && RB == 1 && UN1 == 2 * UN2 && UN1 <= PRE_LOADS;
  // PRE 3: the same first loads into the warp's registers (preg) instead, no shared memory
  constexpr bool rgon = PRE == 3 && QB == 0 && RB == 1 && UN1 == 2 * UN2 && UN1 <= PRE_LOADS;
  constexpr bool anyp = preon || rgon;
  // CHD (MLXP_MEGA_CHD=1, a compile-time choice: engine.fast.mega_chd): no barrier between
  // gate/up and down (CHK: the split column; 0 without it)
  constexpr bool chd = CHK > 0 && RB == 1 && QB == 0 && !anyp && !dyn;
  // CHC (MLXP_MEGA_CHC=1): none between o_proj and gate/up (CCK: the split row; the inputs
  // staged as with STG)
  constexpr bool chc = CCK > 0 && RB == 1 && QB == 0 && STG != 0 && !anyp && !dyn && OGRP == 0;
  uint4 preg[rgon ? PRE_LOADS : 1];
  const bool preA = anyp && !(OPT & MEGA_OPT_QSPLIT) && !qrow;
  uint4* pre = reinterpret_cast<uint4*>(xraw + XBYTES) + warp * PRE * PRE_LOADS * 32;
  auto slot = [&](int k) { return pre + (PRE == 2 ? (k & 1) : 0) * PRE_LOADS * 32; };
  // the copies a warp's k-th unit of a phase uses (none: null), and (PRE 2) those of its next
  // unit (rows r0, r1 of a matrix of K columns) asked for first; `on`: the phase takes PRE
  auto pre_next = [&](auto kk, auto rl, auto un, bool on, int k, bool more, const void* w, int r0, int r1) {
    if constexpr (PRE == 2) {
      if (on && more) mega_preload<T, decltype(kk)::value, decltype(rl)::value, decltype(un)::value>(w, r0, r1, lane, slot(k + 1), pol);
    }
    return preon && on && (k == 0 || PRE == 2) ? slot(k) : nullptr;
  };
  // a phase's first loads of a warp's first unit of the next phase asked for (rows r0, r1 of a
  // matrix of KK columns; RL_ rows, UN_ loads a row): shared memory or registers
#define MEGA_ISSUE(KK, RL_, UN_, W_, R0_, R1_) do { \
    if constexpr (rgon) mega_preload<T, KK, RL_, UN_, true>(W_, R0_, R1_, lane, preg, pol); \
    else mega_preload<T, KK, RL_, UN_>(W_, R0_, R1_, lane, slot(0), pol); } while (0)
  // (a unit's extra arguments to mega_mat_dot: the registers, taken by a phase's first unit)
#define MEGA_RG(ON_, K_) preg, rgon && (ON_) && (K_) == 0
  unsigned int target = 0;
  // PROF: block 0 stamps the global timer (ns) as each phase ends (after its barrier)
#define MEGA_STAMP() do { if (PROF && blockIdx.x == 0 && threadIdx.x == 0) { \
    unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \
    prof[2 * nstamp] = (unsigned int)t_; prof[2 * nstamp + 1] = (unsigned int)(t_ >> 32); } ++nstamp; } while (0)
  // PROF: each block stamps when all its warps are done with the phase (before the barrier)
#define MEGA_ARRIVE() do { if (PROF) { MEGA_SYNC(); if (threadIdx.x == 0) { \
    const unsigned long long t_ = mega_now(); const size_t i_ = 2 * ((size_t)nstamp * gridDim.x + blockIdx.x); \
    arrive[i_] = (unsigned int)t_; arrive[i_ + 1] = (unsigned int)(t_ >> 32); } } } while (0)
  // before a barrier: the warp's first unit of the next phase (RL rows of K elements,
  // rows n and n + OFF) prefetched into L2, so its weights stream while blocks wait (PFCAP: at
  // most the first 16 KB of a unit, so that all warps' prefetches fit in L2 together: the 8B's
  // down rows are 28 KB, 59 MB for the 2112 warps)
#define MEGA_PREFETCH(Wp, KK, NUNITS, RL_, OFF, ROW0_) do { if (PROD == 0 && gw < (NUNITS)) { \
    const int cap_ = (OPT & MEGA_OPT_PFCAP) ? min((KK) * WBITS / 8, 16384 / (RL_)) : (KK) * WBITS / 8; \
    for (int r_ = 0; r_ < (RL_); ++r_) { \
      const char* b_ = reinterpret_cast<const char*>(Wp) + (size_t)((ROW0_) + gw + r_ * (OFF)) * (KK) * WBITS / 8; \
      for (int o_ = lane * 128; o_ < cap_; o_ += 32 * 128) \
        asm volatile("prefetch.global.L2 [%0];" :: "l"(b_ + o_)); } } } while (0)
  MEGA_STAMP();
__TABLES__
  constexpr int WBITS = QB ? QB : 8 * (int)sizeof(T);     // bits a weight element takes
__PRODUCER__
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
  // (STG: a thread's loads of a row issued together before any is used; the same elements
  // per thread, added in the same order)
  // (hin: where x is, hbuf unless said)
  auto load_normed = [&](const T* nw, bool first, const float* hin) {
    float s[RB];
#pragma unroll
    for (int b = 0; b < RB; ++b) s[b] = 0.f;
    if (STG != 0) {
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
    } else {
      for (int k = threadIdx.x; k < H; k += CT) {
        const float w = static_cast<float>(nw[k]);
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          const float v = first ? emb_at(tok[ROW0 + b], k) : __ldcg(hin + b * H + k);
          if (first && blockIdx.x == 0) hbuf[b * H + k] = v;
          s[b] += v * v;
          xn[swn(b * H + k)] = XN(v * w);
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
  // model rounds it; a warp per R1 hidden rows; KK (a mega_int) the matrix's columns
  // (R1 is 1: a unit is a row; DYN: the counters dc)
  // (the residual read from hin, the sum written to hbuf)
  // (n_first: the warp's first row, gw unless CHD took it; cc: CHC's counts, or null)
  auto proj_residual = [&](auto kk, auto un, const void* w, const T* ws_, const T* wb_, bool usepre, unsigned int* dc,
                           const float* hin, int n_first, unsigned int* cc) {
    constexpr int KK = decltype(kk)::value, UNP = decltype(un)::value;   // (UNP: loads in flight)
    static_assert(R1 == 1, "a unit is one row");
    const int NS = dyn_ns(H);
    for (int n0 = n_first, k = 0; n0 < H; ++k) {
      const unsigned int got = dyn_ask(n0, H, NS, dc);
      int idx[R1];
#pragma unroll
      for (int r = 0; r < R1; ++r) idx[r] = min(n0 + r, H - 1);
      float acc[R1 * RB], hres = 0.f;
      // the residual this lane adds to, asked for before the dot so its latency is hidden
      if (lane < R1 * RB && n0 + lane / RB < H) hres = __ldcg(hin + (lane % RB) * H + n0 + lane / RB);
      // (R1 is 1: a unit is the row mega_preload fetched)
      const bool more = n0 + NW * R1 < H;
      const uint4* p_ = pre_next(kk, mega_int<1>{}, mega_int<UN1>{}, usepre, k, more, w, n0 + NW, n0 + NW);
      mega_mat_dot<T, T, KK, R1, RB, UNP, QB, GS>(w, ws_, wb_, idx, xt, lane, acc, pol, 0, p_, PRE == 2 && more,
                                                  MEGA_RG(usepre, k));
#pragma unroll
      for (int r = 0; r < R1; ++r)
#pragma unroll
        for (int b = 0; b < RB; ++b)
          if (lane == r * RB + b && n0 + r < H)
            hbuf[b * H + n0 + r] = static_cast<float>(T(hres + static_cast<float>(T(acc[r * RB + b]))));
__CHC_C__
      n0 = dyn_next(n0, H, NS, got);
    }
__CHC_C_END__
  };

  // the first q/k/v pair (QROW: row) a warp computes in layer l (FLOW: keys and values first)
  auto qkv_first_row = [&]() {
    if (qrow) return flow ? (gw + QD) % NROW : gw;
    const int p = flow ? (gw + NQ * HALF) % NPAIR : gw;
    return (p / HALF) * D + p % HALF;
  };
  if (preA && gw < NPAIR) { const int r1 = qkv_first_row(); MEGA_ISSUE(H, 2, UN2, WQKV[0], r1, r1 + HALF); }
  for (int l = 0; l < L; ++l) {
__QKV__
    MEGA_ARRIVE();
    if (!flow) mega_grid_sync(ctr, target, OPT & MEGA_OPT_BAR, OPT & MEGA_OPT_LEAN);
    MEGA_STAMP();
__ATTENTION__
    if (ogrp) {                  // (no barrier: each o_proj unit waits for its group of heads)
      MEGA_STAMP();
__OGRP__
    } else {
    if (anyp && UNO == UN1 && gw < H) MEGA_ISSUE(QD, 1, UN1, WO[l], gw, gw);   // (PRE: o_proj's
    // copies are UN1 loads: none where o_proj takes another count)
    MEGA_ARRIVE();
    mega_grid_sync(ctr, target, OPT & MEGA_OPT_BAR, OPT & MEGA_OPT_LEAN);
    MEGA_STAMP();
    // --- C: o_proj + residual (a warp per hidden row)
    {
      if constexpr (STG != 0) mega_stage<T, RB * QD, CT>(obuf, xt, swt);
      else for (int k = threadIdx.x; k < RB * QD; k += CT) xt[swt(k)] = T(__ldcg(obuf + k));
      MEGA_SYNC();
      proj_residual(mega_int<QD>{}, mega_int<UNO>{}, WO[l], WO_S[l], WO_B[l], anyp && UNO == UN1, dctr + (l * 5 + 1) * 8,
                    hbuf, gw, chc ? dcnt + 4 * l + 2 : nullptr);
      MEGA_PREFETCH(WGU[l], H, I, 2, I, 0);
      if (anyp && gw < I) MEGA_ISSUE(H, 2, UN2, WGU[l], gw, I + gw);
    }
    }
    // --- D: norm -> gate/up -> SiLU(gate) * up (a warp per pair of rows; CHC: after no
    // barrier, its first pair in two parts, mega_chd)
__CHC_D__
    {
      const int NS = dyn_ns(I);
      for (int n = chc ? gw + NW : gw, k = chc ? 1 : 0; n < I; ++k) {
        const unsigned int got = dyn_ask(n, I, NS, dctr + (l * 5 + 2) * 8);
        const int idx[2] = {n, I + n};
        float acc[2 * RB];
        const bool more = n + NW < I;
        const uint4* p_ = pre_next(mega_int<H>{}, mega_int<2>{}, mega_int<UN2>{}, preon, k, more, WGU[l], n + NW, I + n + NW);
        mega_mat_dot<T, XN, H, 2, RB, UN2, QB, GS>(WGU[l], WGU_S[l], WGU_B[l], idx, xn, lane, acc, pol, 0,
                                                   p_, PRE == 2 && more, MEGA_RG(anyp, k));
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          if (lane != b) continue;
          const float g = static_cast<float>(T(acc[b] * sinv[b]));
          const float up = static_cast<float>(T(acc[RB + b] * sinv[b]));
          const float s = static_cast<float>(T(g / (1.f + __expf(-g))));
          abuf[b * I + n] = static_cast<float>(T(s * up));
        }
__CHD_D__
        n = dyn_next(n, I, NS, got);
      }
      MEGA_PREFETCH(WD[l], I, (H + R1 - 1) / R1, R1, 1, gw * (R1 - 1));
      if (anyp && gw < H) MEGA_ISSUE(I, 1, UN1, WD[l], gw, gw);
    }
    // --- E: down_proj + residual (a warp per hidden row; CHD: after no barrier, mega_chd)
__CHD_E__
    MEGA_ARRIVE();
    mega_grid_sync(ctr, target, OPT & MEGA_OPT_BAR, OPT & MEGA_OPT_LEAN);
    MEGA_STAMP();
    {
      if constexpr (STG != 0) mega_stage<T, RB * I, CT>(abuf, xt, swt);
      else for (int k = threadIdx.x; k < RB * I; k += CT) xt[swt(k)] = T(__ldcg(abuf + k));
      MEGA_SYNC();
      proj_residual(mega_int<I>{}, mega_int<UN1>{}, WD[l], WD_S[l], WD_B[l], anyp, dctr + (l * 5 + 3) * 8,
                    ogrp ? hbuf2 : hbuf, gw, nullptr);
    }
    }
    {
      if (l + 1 < L && gw < (qrow ? NROW : NPAIR)) {      // the next layer's first q/k/v pair (row)
        const int r1 = qkv_first_row();
        if (qrow) MEGA_PREFETCH(WQKV[l + 1], H, NROW, 1, 1, r1 - gw);
        else MEGA_PREFETCH(WQKV[l + 1], H, NPAIR, 2, HALF, r1 - gw);
        if (preA) { const int q1 = qkv_first_row(); MEGA_ISSUE(H, 2, UN2, WQKV[l + 1], q1, q1 + HALF); }
      } else if (l + 1 == L) {
        MEGA_PREFETCH(headw, H, (V + R1 - 1) / R1, R1, 1, gw * (R1 - 1));
        if (anyp && gw < V) MEGA_ISSUE(H, 1, UN1, headw, gw, gw);
      }
    }
    MEGA_ARRIVE();
    mega_grid_sync(ctr, target, OPT & MEGA_OPT_BAR, OPT & MEGA_OPT_LEAN);
    MEGA_STAMP();
  }
  // --- the final norm and the output head (a warp per vocabulary row)
  {
    load_normed(fnorm, L == 0, hbuf);
    const int NS = dyn_ns(V);
    for (int n0 = gw, k = 0; n0 < V; ++k) {
      const unsigned int got = dyn_ask(n0, V, NS, dctr + L * 5 * 8);
      int idx[R1];
#pragma unroll
      for (int r = 0; r < R1; ++r) idx[r] = min(n0 + r, V - 1);
      float acc[R1 * RB];
      const bool more = n0 + NW * R1 < V;
      const uint4* p_ = pre_next(mega_int<H>{}, mega_int<1>{}, mega_int<UN1>{}, preon, k, more, headw, n0 + NW, n0 + NW);
      mega_mat_dot<T, XN, H, R1, RB, UN1, QB, GS>(headw, HEAD_S, HEAD_B, idx, xn, lane, acc, pol, 0,
                                                  p_, PRE == 2 && more, MEGA_RG(anyp, k));
#pragma unroll
      for (int r = 0; r < R1; ++r)
#pragma unroll
        for (int b = 0; b < RB; ++b)
          if (lane == r * RB + b && n0 + r < V) logits[(size_t)b * V + n0 + r] = T(acc[r * RB + b] * sinv[b]);
      n0 = dyn_next(n0, V, NS, got);
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
"""


PER_LAYER = ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")


QUANT = ("wqkv", "wo", "wgu", "wd")       # per layer, the matrices (quantized: + _s, _b)


def input_names(n_layers: int, quantized: bool = False, qk_norm: bool = False) -> list:
    """The kernel's inputs, in order: the step's scalars and shared weights, then per
    layer its norms and projections, (with `qk_norm` then per layer its q and k norm
    weights,) then the key and value caches; with `quantized` every weight matrix (the
    embedding and the head too) is followed by its group scales (`_s`) and biases (`_b`)."""
    q = (lambda n: [n, f"{n}_s", f"{n}_b"]) if quantized else (lambda n: [n])
    names = ["tok", "rpos", "col", "start_col", "opt", *q("emb"), "inv_freq", "fnorm", *q("headw")]
    for i in range(n_layers):
        for k in PER_LAYER:
            names += q(f"{k}_{i}") if k in QUANT else [f"{k}_{i}"]
    if qk_norm:
        names += [n for i in range(n_layers) for n in (f"qn_{i}", f"kn_{i}")]
    names += [f"k_{i}" for i in range(n_layers)] + [f"v_{i}" for i in range(n_layers)]
    # not read: the previous call's workspace, so that MLX orders the calls of one step
    # (two of these kernels running at once could each hold SMs the other waits for)
    return names + ["after"]


def source(n_layers: int, quantized: bool = False, qk_norm: bool = False) -> str:
    """BODY with the per-layer pointer tables for n_layers layers (weight matrices as
    `const void*`: T elements, or packed words with `quantized`; their scale and bias
    tables hold null pointers for float weights; so do the q/k norm tables without
    `qk_norm`)."""
    def table(name, key, kind="const T*", suffix=""):
        cast = "const_cast<T*>({})" if kind == "T*" else "{}"
        items = ", ".join(cast.format(f"{key}_{i}{suffix}") for i in range(n_layers))
        return f"  {kind} {name}[{n_layers}] = {{{items}}};\n"

    def matrix(name, key):
        out = table(name, key, "const void*")
        if quantized:
            return out + table(name + "_S", key, suffix="_s") + table(name + "_B", key, suffix="_b")
        return out + f"  const T* {name}_S[{n_layers}] = {{}};\n  const T* {name}_B[{n_layers}] = {{}};\n"
    tables = (table("LN1", "ln1") + matrix("WQKV", "wqkv") + matrix("WO", "wo") + table("LN2", "ln2")
              + matrix("WGU", "wgu") + matrix("WD", "wd") + table("KC", "k", "T*") + table("VC", "v", "T*"))
    if qk_norm:
        tables += table("QN", "qn") + table("KN", "kn")
    else:
        tables += f"  const T* QN[{n_layers}] = {{}};\n  const T* KN[{n_layers}] = {{}};\n"
    if quantized:
        tables += ("  const T* EMB_S = emb_s; const T* EMB_B = emb_b;\n"
                   "  const T* HEAD_S = headw_s; const T* HEAD_B = headw_b;\n")
    else:
        tables += "  const T* EMB_S = nullptr; const T* EMB_B = nullptr;\n  const T* HEAD_S = nullptr; const T* HEAD_B = nullptr;\n"
    return (BODY.replace("__QKV__\n", Q.QKV).replace("__ATTENTION__\n", A.ATTENTION)
            .replace("__CHD_D__\n", CH.CHD_D).replace("__CHD_E__\n", CH.CHD_E).replace("__CHC_D__\n", CH.CHC_D)
            .replace("__CHC_C__\n", CH.CHC_C).replace("__CHC_C_END__\n", CH.CHC_C_END)
            .replace("__OGRP__\n", O.OGRP).replace("__PRODUCER__\n", P.PRODUCER).replace("__DYN__\n", B.DYN).replace("__TABLES__\n", tables))
