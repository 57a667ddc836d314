"""CUDA source of the one-kernel step's hand-off from gate/up to down without a grid barrier
(`MLXP_MEGA_OPT` value 1024, CHD), spliced into engine.fast.mega_cuda's BODY where `__CHD_D__`
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
"""

from __future__ import annotations

# the end of a gate/up unit n (the k-th of this warp, lane 0 wrote it): its counts
CHD_D = r"""        if (chd && lane == 0 && n < CHK && n + NW >= CHK)
          asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(dcnt + 4 * l), "r"(k + 1) : "memory");
"""

# after gate/up's loop: the warp's units past CHK; then (instead of the barrier) phase E's
# first row in two parts
CHD_E = r"""    if (chd) {
      if (lane == 0 && gw < I) {
        const int all_ = (I - gw + NW - 1) / NW, below_ = gw < CHK ? (CHK - gw + NW - 1) / NW : 0;
        if (all_ > below_)
          asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(dcnt + 4 * l + 1), "r"(all_ - below_) : "memory");
      }
      MEGA_ARRIVE();
      MEGA_STAMP();
      __syncthreads();                  // (this block's warps are done with gate/up's input)
      if (threadIdx.x == 0) mega_wait_at_least(dcnt + 4 * l, CHK);
      __syncthreads();
      mega_stage<T, (CHK > 0 ? CHK : 4), THREADS>(abuf, xt, swt);
      __syncthreads();
      float acc_[1] = {0.f}, hres_ = 0.f;
      const int idx_[1] = {gw};
      if (gw < H) {
        if (lane == 0) hres_ = __ldcg((ogrp ? hbuf2 : hbuf) + gw);
        mega_mat_dot<T, T, (CHK > 0 ? CHK : 256), 1, 1, UN1, 0, GS, I, true, false>(WD[l], WD_S[l], WD_B[l], idx_, xt,
                                                                                   lane, acc_, pol, 0);
      }
      if (threadIdx.x == 0) mega_wait_at_least(dcnt + 4 * l + 1, I - CHK);
      __syncthreads();
      mega_stage<T, (CHK > 0 ? I - CHK : 4), THREADS>(abuf + CHK, xt + CHK, swt);
      __syncthreads();
      if (gw < H) {
        mega_mat_dot<T, T, (CHK > 0 ? I - CHK : 256), 1, 1, UN1, 0, GS, I, false, true>(WD[l], WD_S[l], WD_B[l], idx_,
                                                                                       xt, lane, acc_, pol, CHK);
        if (lane == 0) hbuf[gw] = static_cast<float>(T(hres_ + static_cast<float>(T(acc_[0]))));
      }
      proj_residual(mega_int<I>{}, mega_int<UN1>{}, WD[l], WD_S[l], WD_B[l], false, dctr + (l * 5 + 3) * 8,
                    ogrp ? hbuf2 : hbuf, gw + NW);
    } else {
"""

VEC_COLUMNS = 256       # a split column is a multiple of this (32 lanes x 16 bytes of bf16/fp16)


def split_column(inter: int, blocks: int, warps_per_block: int) -> int:
    """CHK for gate/up's `inter` units dealt over blocks x warps_per_block warps: the largest
    multiple of VEC_COLUMNS inside the rounds before the last (0: no such split — a single
    round, or `inter` not a multiple of VEC_COLUMNS)."""
    nw = blocks * warps_per_block
    if nw <= 0 or inter % VEC_COLUMNS:
        return 0
    rounds = -(-inter // nw)
    if rounds < 2:
        return 0
    ks = min(nw * (rounds - 1), inter) // VEC_COLUMNS * VEC_COLUMNS
    # (every warp's first unit below it: the first count then says every block is past the norm)
    return ks if nw <= ks < inter else 0
