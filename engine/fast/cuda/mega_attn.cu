// The one-kernel step's attention phase (B); included by mega_step.cu inside its loop over the
// layers.
//
// A warp per (row, query head, chunk of CS cached columns): lane j scores column j of each 32
// (its key row read whole, in 16-byte loads), then the lanes own DPL contiguous output dims and
// add up p_j * v_j, VB columns' value loads issued before they are used (one load of DPL values
// per column). A chunk's partial (max, sum, output) goes to the workspace; the last warp to
// finish a (row, head)'s chunks (a counter each) combines them into the attention output, its
// lanes sharing the chunks (a round trip to L2 for the maxima and sums, one per 16 chunks for
// the outputs with head sizes up to 64, 12 up to 128).
// With FLOW (one-row calls) no grid barrier precedes the phase: a unit waits for its query head's
// flag (phase A counts the head's, its key head's and its value head's pairs into it), then
// reads its query head into the warp's slot of shared memory; the last warps take the first
// units. A chunk's counter is taken with one acquire/release add after a warp sync (no fences).
// At its end each warp asks L2 for its first o_proj row of the next phase.
    // --- B: attention, a warp per (row, query head, chunk of CS columns): lane j scores
    // column j of each 32 (its key row read whole), then the lanes own DPL of the D
    // output dims and add up p_j * v_j (a batch of value loads issued at once); a chunk's
    // partial (max, sum, output) goes to the workspace, and the last warp to finish a
    // (row, head)'s chunks (a counter each) combines them into obuf.
    {
      if constexpr (!flow) {
        mega_stage<float, RB * QD, CT>(qbuf, xf, [](int i) { return i; });
        MEGA_SYNC();
      }
      const T* kcache = KC[l];
      const T* vcache = VC[l];
      // (FLOW: the last warps take the first units: they are the ones done with phase A first,
      // and the first heads' flags are the first up)
      for (int u = flow ? NW - 1 - gw : gw; u < RB * NQ * nch; u += NW) {
        const int b = u / (NQ * nch), hq = (u / nch) % NQ, c = u % nch, g = hq / (NQ / NKV);
        const size_t row = (size_t)crow[ROW0 + b];     // (its cache row)
        const T* kb = kcache + (row * NKV + g) * CAP * D;
        const T* vb = vcache + (row * NKV + g) * CAP * D;
        const int start = max(c * cs, start_col[ROW0 + b]), end = min(col[ROW0 + b] + 1 - L3_FAULT_DROP, c * cs + cs);
        const float* qh = xf + b * QD + hq * D;
        if (flow) {     // the query head, its keys and its values out of phase A, then q here
          // (one flag: the query's, key's and value's pairs)
          if (lane == 0) mega_wait_at_least(fcnt + l * (NQ + 2 * NKV) + hq, 3 * HALF);
          __syncwarp();
          for (int d = lane; d < D; d += 32) qslot[warp][d] = __ldcg(qbuf + b * QD + hq * D + d);
          __syncwarp();
          qh = qslot[warp];
        }
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
          {
            // the values for this lane's dims, VB columns' loads issued before they are used
            // (up to 4 values a lane: all 32 columns' loads at once, kept raw until used, in the
            // registers 16 columns' floats took)
            constexpr bool raw = DPL > 2 && DPL <= 4;
            constexpr int VB = DPL <= 2 || raw ? 32 : 16;
#pragma unroll
            for (int j0 = 0; j0 < 32; j0 += VB) {
              float vv[raw ? 1 : VB][DPL];
              mega_vals<T, DPL> vw[raw ? VB : 1];
#pragma unroll
              for (int j = 0; j < VB; ++j) {   // the lane's DPL contiguous values, one load
                const T* src = vb + (size_t)min(p0 + j0 + j, end - 1) * D + lane * DPL;
                if constexpr (raw) vw[j] = mega_ldcg_raw<T, DPL>(src);
                else mega_ldcg_vec<T, DPL>(src, vv[j]);
              }
#pragma unroll
              for (int j = 0; j < VB; ++j) {
                const float pjj = __shfl_sync(0xffffffffu, pj, j0 + j);
#pragma unroll
                for (int d = 0; d < DPL; ++d)
                  o[d] += pjj * (raw ? static_cast<float>(vw[raw ? j : 0].e[d]) : vv[raw ? 0 : j][d]);
              }
            }
          }
          m = mn;
        }
        float* pr = part + (((size_t)b * NQ + hq) * MAXCH + c) * PSTR;
#pragma unroll
        for (int d = 0; d < DPL; ++d) pr[lane * DPL + d] = o[d];
        if (lane == 0) { pr[D] = m; pr[D + 1] = lsum; }
        unsigned int done = 0;
        unsigned int* hc = hcnt + ((size_t)l * RB + b) * NQ + hq;
        __syncwarp();                   // the lanes' partials ordered by the warp sync + release
        if (lane == 0) done = mega_atom_add_acq_rel(hc, 1u);
        done = __shfl_sync(0xffffffffu, done, 0);
        if (done == (unsigned int)(nch - 1)) {        // the last chunk of (row, head): combine
          // lanes take chunks lane and lane + 32: the max and the weights in one round trip,
          // then every chunk's output (the lane's DPL values), CB chunks' loads at once
          const float* p2 = part + ((size_t)b * NQ + hq) * MAXCH * PSTR;
          constexpr int CB = DPL <= 2 ? 16 : DPL <= 4 ? 12 : 8;
          float ov[CB][DPL];
          auto load_outputs = [&](int c0) {
#pragma unroll
            for (int j = 0; j < CB; ++j)
              if (c0 + j < nch) mega_ldcg_vec<float, DPL>(p2 + (c0 + j) * PSTR + lane * DPL, ov[j]);
          };
          float mc0 = NEG_INF, mc1 = NEG_INF, l0 = 0.f, l1 = 0.f;
          if (lane < nch) { mc0 = __ldcg(p2 + lane * PSTR + D); l0 = __ldcg(p2 + lane * PSTR + D + 1); }
          if (lane + 32 < nch) { mc1 = __ldcg(p2 + (lane + 32) * PSTR + D); l1 = __ldcg(p2 + (lane + 32) * PSTR + D + 1); }
          const float M = mega_warp_max(fmaxf(mc0, mc1));
          const float w0 = mc0 == NEG_INF ? 0.f : __expf(mc0 - M), w1 = mc1 == NEG_INF ? 0.f : __expf(mc1 - M);
          const float ls = mega_warp_sum(w0 * l0 + w1 * l1);
          float acc[DPL];
#pragma unroll
          for (int d = 0; d < DPL; ++d) acc[d] = 0.f;
          for (int c0 = 0; c0 < nch; c0 += CB) {
            load_outputs(c0);
#pragma unroll
            for (int j = 0; j < CB; ++j) {
              const int cc = c0 + j;          // (the same on every lane)
              const float wgt = __shfl_sync(0xffffffffu, cc < 32 ? w0 : w1, cc & 31);
              if (cc < nch)
#pragma unroll
                for (int d = 0; d < DPL; ++d) acc[d] += wgt * ov[j][d];
            }
          }
#pragma unroll
          for (int d = 0; d < DPL; ++d)
            obuf[b * QD + hq * D + lane * DPL + d] = static_cast<float>(T(ls > 0.f ? acc[d] / ls : 0.f));
        }
      }
      MEGA_PREFETCH(WO[l], QD, (H + R1 - 1) / R1, R1, 1, gw * (R1 - 1));
    }
