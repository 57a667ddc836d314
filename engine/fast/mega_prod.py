"""CUDA source of the one-kernel step's producer warp (MLXP_MEGA_PROD), spliced into
engine.fast.mega_cuda's BODY where `__PRODUCER__` stands.

With PROD > 0 (one row a call, float weights, none of the other compile-time kernel choices)
the last warp of each block computes nothing: it walks through the same units the block's
other 15 warps take — q/k/v pairs, o_proj rows, gate/up pairs, down rows over the layers,
then the head's rows — and asks L2 for their weights, a 128-byte line of each of the round's
rows at a time (`prefetch.global.L2`; with PBULK a 1 KB bulk prefetch through the copy engine,
`cp.async.bulk.prefetch.L2`, sm_90 and later), the rows' lines in the order the warps read them,
at most PROD KB ahead of what those warps have asked for so far (they add the bytes of each
batch of weight loads to `mega_pdone` in shared memory). It never waits for a barrier, so the
weights of the next phase stream from memory while the warps wait at one, stage the phase's
input and run attention, and the warps' own loads then find them in L2. The projections'
products and their order are those of the kernel without it, but the RMSNorm's sum of squares
strides by the 480 computing threads, so the logits differ slightly (measured on an H200, where
the kernel was also slower: reports/l3_profile/0.2.9/h200-prod-bal). With
`MEGA_OPT_KVPF` (MLXP_MEGA_OPT value 2) the producers, not phase A's threads, also ask L2 for
the layer's cached keys and values once its q/k/v rows are asked for (the lines dealt across the
blocks, outside the window's count).
"""

PRODUCER = r"""#ifdef MEGA_PRODUCER
  if constexpr (PROD > 0) {
    if (threadIdx.x == 0) mega_pdone = 0u;
    __syncthreads();                  // (every warp, the producer too: the count starts at 0)
    if (warp == WPB) {
      constexpr int WIN = PROD * 1024;
#if __CUDA_ARCH__ >= 900
      constexpr bool bulk = PBULK != 0;
#else
      constexpr bool bulk = false;      // (bulk prefetches need sm_90)
#endif
      const volatile unsigned int* pdone = &mega_pdone;
      unsigned int issued = 0u;
      // lane j: row j / WPB of the unit warp j % WPB takes in each round
      const int pw = lane % WPB, pk = lane / WPB;
      const int pgw = (OPT & MEGA_OPT_SPREAD) ? pw * (int)gridDim.x + (int)blockIdx.x
                                              : (int)blockIdx.x * WPB + pw;
      // a phase of N units of RL rows of RBY bytes; row k of unit u0 at rowp(u0, k)
      auto stream = [&](int N, int RL, int RBY, auto rowp) {
        for (int u0 = pgw; ; u0 += NW) {
          const bool on = pk < RL && u0 < N;
          const unsigned int act = __popc(__ballot_sync(0xffffffffu, on));
          if (act == 0u) break;
          const char* p = on ? rowp(u0, pk) : nullptr;
          if constexpr (bulk) {   // (PBULK: 1 KB a request, through the copy engine)
            for (int off = 0; off < RBY; off += 1024) {
              const int n = RBY - off < 1024 ? RBY - off : 1024;
              while ((int)(issued - *pdone) > WIN) __nanosleep(64);
              if (on) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + off), "r"(n) : "memory");
              issued += act * (unsigned int)n;
            }
          } else {
            for (int off = 0; off < RBY; off += 128) {
              while ((int)(issued - *pdone) > WIN) __nanosleep(64);
              if (on) asm volatile("prefetch.global.L2 [%0];" :: "l"(p + off));
              issued += act * 128u;
            }
          }
        }
      };
      constexpr int TB = (int)sizeof(T);
      for (int l = 0; l < L; ++l) {
        const char* wqkv = reinterpret_cast<const char*>(WQKV[l]);
        stream(NPAIR, 2, H * TB, [&](int u0, int k) {
          const int u = flow ? (u0 + NQ * HALF) % NPAIR : u0;
          return wqkv + (size_t)((u / HALF) * D + u % HALF + k * HALF) * H * TB;
        });
        if (OPT & MEGA_OPT_KVPF) {    // the layer's cached keys and values (not counted: no
          // warp counts them), the lines dealt across the blocks (phase A's loop in mega_qkv with
          // the producer's lanes; not shared through a function: that moved the default kernel's code)
          const size_t lo = (size_t)start_col[ROW0] * D * TB / 128 * 128, hi = (size_t)wcol * D * TB;
          const int nl = hi > lo ? (int)((hi - lo + 127) / 128) : 0;
          for (int j = (int)blockIdx.x * 32 + lane; j < 2 * NKV * nl; j += (int)gridDim.x * 32) {
            const int g = (j / nl) % NKV;
            const T* base = ((j / nl) < NKV ? KC[l] : VC[l]) + ((size_t)ROW0 * NKV + g) * CAP * D;
            asm volatile("prefetch.global.L2 [%0];" :: "l"(reinterpret_cast<const char*>(base) + lo + (size_t)(j % nl) * 128));
          }
        }
        const char* wo = reinterpret_cast<const char*>(WO[l]);
        stream(H, 1, QD * TB, [&](int u0, int k) { return wo + (size_t)u0 * QD * TB; });
        const char* wgu = reinterpret_cast<const char*>(WGU[l]);
        stream(I, 2, H * TB, [&](int u0, int k) { return wgu + (size_t)(u0 + k * I) * H * TB; });
        const char* wd = reinterpret_cast<const char*>(WD[l]);
        stream(H, 1, I * TB, [&](int u0, int k) { return wd + (size_t)u0 * I * TB; });
      }
      const char* wh = reinterpret_cast<const char*>(headw);
      stream(V, 1, H * TB, [&](int u0, int k) { return wh + (size_t)u0 * H * TB; });
      return;
    }
  }
#endif
"""
