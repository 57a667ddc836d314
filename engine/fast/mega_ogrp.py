"""CUDA source of the one-kernel step's o_proj by groups of query heads (MLXP_MEGA_OGRP=1),
spliced into engine.fast.mega_cuda's BODY where `__OGRP__` stands, in place of the barrier
after attention and phase C.

With FLOW, one row a call and float weights: the query heads that share a key/value head form
a group (its QG = NQ/NKV * D attention outputs, contiguous). The attention combine counts each
head's output out on its group's flag; o_proj runs in units of ORO (4) rows x one group's QG columns,
handed out by 8 counters in group order, each waiting for its group only, so o_proj streams while
the last heads' attention is still running instead of after a grid barrier. A unit's partial
sums (float) go to the workspace; the unit that completes a block of rows (a counter each) adds
the NKV partials in group order, rounds the sum to the model's dtype and adds the residual as
the model rounds it, into a second residual buffer (blocks still in phase A's norm may be reading
the first; gate_up's norm and down's residual read the second). The partial sums change the order of the additions, so its logits differ
from the default kernel's in the last bits (an L3 difference, gated like the rest). With
MLXP_MEGA_PROF=1 the attention phase ends when block 0 is done with its own attention units (no
barrier marks it) and the blocks' arrivals at its end are not recorded (left at 0).
"""

OGRP = r"""    // --- C (OGRP): o_proj by groups of query heads, each unit waiting for its group only
    {
      constexpr int G = NQ / NKV, QG = G * D, RO = ORO, NB = H / RO, NU = NKV * NB;
      // this warp's copy of its unit's group outputs (not in the phase inputs' memory: with FLOW
      // other warps of the block may still be reading phase A's input there)
      T* xs = ogx + warp * QG;
      int have = -1;                          // the group in xs
      // (8 counters, warp gw asking counter gw % 8: its j-th answer is unit gw % 8 + 8 j)
      unsigned int* oc = octr + l * 8 + (gw & 7);
      int u = 0;
      if (lane == 0) u = (gw & 7) + 8 * (int)atomicAdd(oc, 1u);
      u = __shfl_sync(0xffffffffu, u, 0);
      while (u < NU) {
        unsigned int nxt = 0u;
        if (lane == 0) nxt = (gw & 7) + 8 * atomicAdd(oc, 1u);   // (the next unit, asked for now)
        const int g = u / NB, n0 = (u % NB) * RO;
        if (g != have) {                      // the group's heads combined: their outputs into xs
          if (lane == 0) mega_wait_at_least(gdone + l * NKV + g, G);
          __syncwarp();
          for (int k = lane * 4; k < QG; k += 128) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(obuf + g * QG + k));
            xs[k] = T(v.x);
            xs[k + 1] = T(v.y);
            xs[k + 2] = T(v.z);
            xs[k + 3] = T(v.w);
          }
          __syncwarp();
          have = g;
        }
        int idx[RO];
#pragma unroll
        for (int r = 0; r < RO; ++r) idx[r] = n0 + r;
        float acc[RO];
        // (the dot reads its input at xs + koff + k: xs shifted back by the group's offset)
        mega_mat_dot<T, T, QG, RO, 1, 2, QB, GS, QD>(WO[l], WO_S[l], WO_B[l], idx, xs - g * QG, lane, acc, pol,
                                                    g * QG);
#pragma unroll
        for (int r = 0; r < RO; ++r)
          if (lane == r) opart[g * H + n0 + r] = acc[r];
        __syncwarp();
        unsigned int done = 0u;
        if (lane == 0) done = mega_atom_add_acq_rel(rcnt + l * NB + n0 / RO, 1u);
        done = __shfl_sync(0xffffffffu, done, 0);
        __syncwarp();
        if (done == (unsigned int)(NKV - 1) && lane < RO) {   // the rows' last group: sum, residual
          float s = 0.f;
          for (int gg = 0; gg < NKV; ++gg) s += __ldcg(opart + gg * H + n0 + lane);
          const float h = __ldcg(hbuf + n0 + lane);
          // (into hbuf2: blocks still in phase A's norm may be reading hbuf)
          hbuf2[n0 + lane] = static_cast<float>(T(h + static_cast<float>(T(s))));
        }
        u = (int)__shfl_sync(0xffffffffu, nxt, 0);
      }
      MEGA_PREFETCH(WGU[l], H, I, 2, I, 0);
      if (anyp && gw < I) MEGA_ISSUE(H, 2, UN2, WGU[l], gw, I + gw);
    }
"""
