"""CUDA source of the one-kernel step's hand-offs without a grid barrier: gate/up to down
(`MLXP_MEGA_CHD=1`, a compile-time choice: another kernel), spliced into engine.fast.mega_cuda's BODY where `__CHD_D__`
(the end of each gate/up unit) and `__CHD_E__` (the start of phase E) stand.

Gate/up's units are dealt in rounds: unit n (the n-th SiLU·up output) goes to warp n mod NW in
round n / NW. `CHK` (from the host, `split_column`) is the largest multiple of 256 columns that
lies inside the rounds before the last: every warp has a unit there. Each warp counts its units
below CHK on one counter of the layer (one release-add, as soon as its next unit is past CHK)
and the rest on a second one (one release-add at the end). Down's rows then start without the
barrier: a block whose warps are done with gate/up waits until the first counter says all
CHK columns are out, stages them, and each warp adds its first row's products over those
columns (each lane keeps its own sums); then it waits for the second counter, stages the last
columns, goes on with the same lanes' sums over them and adds across the warp. Every lane adds
the same products in the same order as over the whole row (the split is at a multiple of 32
lanes x 16 bytes), so the logits are bit-identical to the kernel with the barrier. Every warp
having a unit below CHK, the first counter's total also says every block is past gate/up's
input norm, whose residual down then writes. One row a call, float weights, without PRE or
DYN (elsewhere the barrier stays). With MLXP_MEGA_PROF=1 gate/up ends when block 0 is done
with its own units.

The same for the hand-off from o_proj to gate/up (`MLXP_MEGA_CHC=1`; `__CHC_D__`
in the BODY, where the barrier before phase D stands): o_proj's rows are dealt in rounds as
well, `CCK` (`split_rows`) is the largest multiple of 512 (a block's threads x whole 16-byte
loads) inside the rounds before the last, and the warps count their rows below and above it
on two more counters of the layer. A block whose warps are done with o_proj waits for the
first count, stages the residual's first CCK elements times the norm's weights (each thread its
elements, in the order of the whole norm, adding their squares) and adds its first gate/up
pair's products over them; then it waits for the second count, stages the rest, completes the
sum of squares and the norm's scale as the whole norm does, and finishes the pair. Gate/up's
input changes nothing o_proj still reads, so the rounds alone decide the split. The same
values in the same order again: logits bit-identical. One row, float weights, the inputs read
together (`MLXP_MEGA_STAGE`, the default), without PRE, DYN or OGRP. With MLXP_MEGA_PROF=1 o_proj
ends when block 0 is done with its own rows.
"""

from __future__ import annotations

# the end of a gate/up unit n (the k-th of this warp, lane 0 wrote it): its counts
CHD_D = r"""        if constexpr (chd) {
          if (lane == 0 && n < CHK && n + NW >= CHK)
            asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(dcnt + 4 * l), "r"(k + 1) : "memory");
        }
"""

# after gate/up's loop: the warp's units past CHK; then (instead of the barrier) phase E's
# first row in two parts
CHD_E = r"""    if constexpr (chd) {
      if (lane == 0 && gw < I) {
        const int all_ = (I - gw + NW - 1) / NW, below_ = gw < CHK ? (CHK - gw + NW - 1) / NW : 0;
        if (all_ > below_)
          asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(dcnt + 4 * l + 1), "r"(all_ - below_) : "memory");
      }
      MEGA_ARRIVE();
      MEGA_STAMP();
      MEGA_SYNC();                  // (this block's warps are done with gate/up's input)
      if (threadIdx.x == 0) mega_wait_at_least(dcnt + 4 * l, CHK);
      MEGA_SYNC();
      mega_stage<T, (CHK > 0 ? CHK : 4), THREADS>(abuf, xt, swt);
      MEGA_SYNC();
      float acc_[1] = {0.f}, hres_ = 0.f;
      const int idx_[1] = {gw};
      if (gw < H) {
        if (lane == 0) hres_ = __ldcg((ogrp ? hbuf2 : hbuf) + gw);
        mega_mat_dot<T, T, (CHK > 0 ? CHK : 256), 1, 1, UN1, 0, GS, I, true, false>(WD[l], WD_S[l], WD_B[l], idx_, xt,
                                                                                   lane, acc_, pol, 0);
      }
      if (threadIdx.x == 0) mega_wait_at_least(dcnt + 4 * l + 1, I - CHK);
      MEGA_SYNC();
      mega_stage<T, (CHK > 0 ? I - CHK : 4), THREADS>(abuf + CHK, xt + CHK, swt);
      MEGA_SYNC();
      if (gw < H) {
        mega_mat_dot<T, T, (CHK > 0 ? I - CHK : 256), 1, 1, UN1, 0, GS, I, false, true>(WD[l], WD_S[l], WD_B[l], idx_,
                                                                                       xt, lane, acc_, pol, CHK);
        if (lane == 0) hbuf[gw] = static_cast<float>(T(hres_ + static_cast<float>(T(acc_[0]))));
      }
      proj_residual(mega_int<I>{}, mega_int<UN1>{}, WD[l], WD_S[l], WD_B[l], false, dctr + (l * 5 + 3) * 8,
                    ogrp ? hbuf2 : hbuf, gw + NW, nullptr);
    } else {
"""

# phase D's first pair in two parts (instead of the barrier and the norm), then its other pairs
CHC_D = r"""    if constexpr (chc) {
      MEGA_ARRIVE();
      MEGA_STAMP();
      MEGA_SYNC();                  // (this block's warps are done with o_proj's input)
      if (threadIdx.x == 0) mega_wait_at_least(dcnt + 4 * l + 2, CCK);
      MEGA_SYNC();
      // (CCK 0, no CHC: placeholders that compile for any H)
      constexpr int PT_ = mega_cmax(H / THREADS, 2), P1_ = CCK > 0 ? CCK / THREADS : 1;
      float s_ = 0.f;
      // a thread's elements threadIdx.x + j * THREADS, j in [j0, j1): x * w staged, x^2 added
      auto part_ = [&](auto j0, auto j1) {
        constexpr int A_ = decltype(j0)::value, B_ = decltype(j1)::value;
        float w_[mega_cmax(B_ - A_, 1)], v_[mega_cmax(B_ - A_, 1)];
#pragma unroll
        for (int j = A_; j < B_; ++j) w_[j - A_] = static_cast<float>(LN2[l][threadIdx.x + j * THREADS]);
#pragma unroll
        for (int j = A_; j < B_; ++j) v_[j - A_] = __ldcg(hbuf + threadIdx.x + j * THREADS);
#pragma unroll
        for (int j = A_; j < B_; ++j) {
          s_ += v_[j - A_] * v_[j - A_];
          xn[threadIdx.x + j * THREADS] = XN(v_[j - A_] * w_[j - A_]);
        }
      };
      part_(mega_int<0>{}, mega_int<P1_>{});
      MEGA_SYNC();
      float acc_[2] = {0.f, 0.f};
      const int idx_[2] = {gw, I + gw};
      if (gw < I)
        mega_mat_dot<T, XN, (CCK > 0 ? CCK : 256), 2, 1, UN2, 0, GS, H, true, false>(WGU[l], WGU_S[l], WGU_B[l], idx_,
                                                                                    xn, lane, acc_, pol, 0);
      if (threadIdx.x == 0) mega_wait_at_least(dcnt + 4 * l + 3, H - CCK);
      MEGA_SYNC();
      part_(mega_int<P1_>{}, mega_int<PT_>{});
      s_ = mega_warp_sum(s_);
      if (lane == 0) red[warp][0] = s_;
      MEGA_SYNC();
      if (threadIdx.x == 0) {
        float tot = 0.f;
#pragma unroll
        for (int w = 0; w < WPB; ++w) tot += red[w][0];
        sinv[0] = rsqrtf(tot / H + eps);
      }
      MEGA_SYNC();
      if (gw < I) {
        mega_mat_dot<T, XN, (CCK > 0 ? H - CCK : 256), 2, 1, UN2, 0, GS, H, false, true>(WGU[l], WGU_S[l], WGU_B[l],
                                                                                        idx_, xn, lane, acc_, pol, CCK);
        if (lane == 0) {
          const float g = static_cast<float>(T(acc_[0] * sinv[0]));
          const float up = static_cast<float>(T(acc_[1] * sinv[0]));
          const float sg = static_cast<float>(T(g / (1.f + __expf(-g))));
          abuf[gw] = static_cast<float>(T(sg * up));
        }
        const int n = gw, k = 0;
""" + CHD_D + r"""      }
    } else {
      MEGA_ARRIVE();
      mega_grid_sync(ctr, target, OPT & MEGA_OPT_BAR, OPT & MEGA_OPT_LEAN);
      MEGA_STAMP();
      load_normed(LN2[l], false, ogrp ? hbuf2 : hbuf);
    }
"""

# o_proj's rows (proj_residual with counters cc): the first count as the warp's next row is past
# CCK, the rest after its last row
CHC_C = r"""      if constexpr (chc) {
        if (cc != nullptr && lane == 0 && n0 < CCK && n0 + NW >= CCK)
          asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(cc), "r"(k + 1) : "memory");
      }
"""
CHC_C_END = r"""    if constexpr (chc) {
      if (cc != nullptr && lane == 0 && n_first < H) {
        const int all_ = (H - n_first + NW - 1) / NW, below_ = n_first < CCK ? (CCK - n_first + NW - 1) / NW : 0;
        if (all_ > below_)
          asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(cc + 1), "r"(all_ - below_) : "memory");
      }
    }
"""

ROW_COLUMNS = 512       # a CHC split is a multiple of this (a block's threads; 32 lanes x 16 bytes)
VEC_COLUMNS = 256       # a CHD split is a multiple of this (32 lanes x 16 bytes of bf16/fp16)


def _split(n: int, nw: int, step: int, lowest: int) -> int:
    """The largest multiple of `step` inside the rounds before the last of `n` units dealt over
    `nw` warps, if it is at least `lowest` (0: none — a single round, `n` not a multiple of
    `step`, or no such multiple)."""
    if nw <= 0 or step <= 0 or n % step:
        return 0
    rounds = -(-n // nw)
    if rounds < 2:
        return 0
    ks = min(nw * (rounds - 1), n) // step * step
    return ks if max(lowest, 1) <= ks < n else 0


def split_rows(hidden: int, blocks: int, warps_per_block: int, threads: int = 512) -> int:
    """CCK for o_proj's `hidden` rows dealt over blocks x warps_per_block warps: the largest
    multiple of ROW_COLUMNS (and of `threads`) inside the rounds before the last (0: none)."""
    if max(ROW_COLUMNS, threads) % min(ROW_COLUMNS, threads):
        return 0
    return _split(hidden, blocks * warps_per_block, max(ROW_COLUMNS, threads), 1)


def split_column(inter: int, blocks: int, warps_per_block: int) -> int:
    """CHK for gate/up's `inter` units dealt over blocks x warps_per_block warps: the largest
    multiple of VEC_COLUMNS inside the rounds before the last, past every warp's first unit (the
    first count then says every block is past the norm; 0: none)."""
    nw = blocks * warps_per_block
    return _split(inter, nw, VEC_COLUMNS, nw)
