"""Affine 4-bit projections of a few rows on the tensor cores (`cuda/qmm_rows.cu`).

The fast step runs the rows that one call of the one-kernel step does not take (more than
`engine.fast.mega.rows_per_call`) as a step of separate kernels (`step.gemv_stack`); for a
4-bit model its projections were MLX's quantized matmul, which on CUDA reads the weights far
below the card's bandwidth at 8-32 rows. `linear(module, x, residual=, silu_split=)` computes
`module(x)` for up to `MAX_ROWS` rows in one kernel: each 16-byte weight read is dequantized
to bf16 in registers and multiplied with every row on the tensor cores (`mma.m16n8k16`), with
the residual add (o_proj, down_proj) or SiLU(gate) * up (the merged gate/up projection) fused
after it. The weight is the one MLX's dequantize gives, rounded to bf16; sums in float: an L3
kernel (its rounding differs from MLX's, which the L3 gate measures).

`supports(module)` says which modules take it: `nn.QuantizedLinear` (or the tied head's
`nn.QuantizedEmbedding`) with 4-bit affine weights, group size 32/64/128, bf16 scales, no bias,
K a multiple of 128 and N of 16. `QmmConfig` is the launch layout (`experiments/qmm_probe.py`
times the layouts against MLX's quantized matmul on a GPU). `mirror` is the lanes' arithmetic
in numpy, so the CPU checks the fragment mapping (tests/engine/test_qmm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .sources import source

MAX_ROWS = 32          # rows a call takes (4 groups of 8)


@dataclass(frozen=True)
class QmmConfig:
    """How a call is laid out: `warps` a block, `unroll` chunks' weight loads in flight a
    warp, and the warps a projection should keep busy (`min_warps`: K is split over up to
    `warps` warps a tile until it does)."""
    warps: int = 8
    unroll: int = 2
    min_warps: int = 4096

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps must be 1, 2, 4, 8 or 16, not {self.warps}")
        if self.unroll < 1 or self.min_warps < 1:
            raise ValueError("unroll and min_warps must be >= 1")

    def ksplit(self, tiles: int, chunks: int) -> int:
        """Warps a tile of 16 weight rows (a power of two dividing `warps`): more while the
        projection's tiles keep fewer than `min_warps` warps busy and every warp keeps at
        least two chunks of 128 columns."""
        ks = 1
        while ks < self.warps and tiles * ks < self.min_warps and chunks >= 4 * ks:
            ks *= 2
        return ks


DEFAULT = QmmConfig()


def supports(module) -> bool:
    """A module the kernel takes (see the module docstring)."""
    if type(module) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or "bias" in module:
        return False
    if getattr(module, "bits", None) != 4 or getattr(module, "group_size", None) not in (32, 64, 128):
        return False
    if getattr(module, "mode", "affine") != "affine" or "biases" not in module:
        return False
    w, s = module["weight"], module["scales"]
    N, K = w.shape[0], w.shape[1] * 8
    return w.dtype == mx.uint32 and s.dtype == mx.bfloat16 and K % 128 == 0 and N % 16 == 0


def _kernel():
    from . import kernels as KR            # (built there, so that KR.empty_kernels covers it)
    return KR.cuda_kernel("mlxp_qmm_rows", ["w", "scales", "biases", "x", "residual"], ["y"],
                          source("qmm_rows.cu"), source("gemv.cuh"))


def linear(module, x: mx.array, *, residual: Optional[mx.array] = None,
           silu_split: Optional[int] = None, config: QmmConfig = DEFAULT) -> mx.array:
    """module(x) (+ residual, or SiLU(gate) * up of a merged gate/up module of 2 * silu_split
    rows) for x [..., K] of at most MAX_ROWS rows, as one CUDA kernel (GPU only)."""
    w, s, b = module["weight"], module["scales"], module["biases"]
    N, K = w.shape[0], w.shape[1] * 8
    if x.shape[-1] != K:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {K}")
    rows = x.size // K
    if rows > MAX_ROWS:
        raise ValueError(f"qmm takes at most {MAX_ROWS} rows, got {rows}")
    if silu_split is not None and (N != 2 * silu_split or silu_split % 8):
        raise ValueError("silu_split needs a merged gate/up weight of 2 * I rows, I a multiple of 8")
    nout = silu_split if silu_split is not None else N
    epi = 2 if silu_split is not None else (1 if residual is not None else 0)
    tiles = nout // 8 if epi == 2 else N // 16
    ks = config.ksplit(tiles, K // 128)
    per = config.warps // ks
    res = (residual.astype(mx.bfloat16).reshape(rows, nout) if residual is not None
           else mx.zeros((1,), mx.bfloat16))
    (y,) = _kernel()(
        inputs=[w, s, b, x.astype(mx.bfloat16).reshape(rows, K), res],
        template=[("T", mx.bfloat16), ("K", K), ("NOUT", nout), ("M", rows), ("MT", -(-rows // 8)),
                  ("GS", module.group_size), ("WARPS", config.warps), ("KS", ks),
                  ("UN", config.unroll), ("EPI", epi)],
        grid=(-(-tiles // per) * config.warps * 32, 1, 1), threadgroup=(config.warps * 32, 1, 1),
        output_shapes=[(rows, nout)], output_dtypes=[mx.bfloat16])
    return y.reshape(*x.shape[:-1], nout)


# --- the lanes' arithmetic in numpy (the CPU's check of the fragment mapping) -------------

def mirror(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, x: np.ndarray,
           group_size: int) -> np.ndarray:
    """What qmm_rows.cu computes for one tile of 16 weight rows (EPI 0), lane by lane:
    words [16, K/8] uint32 (MLX's packing), scales / biases [16, K/GS], x [M <= 8, K] ->
    [M, 16], each mma.m16n8k16 formed from the fragments the lanes build (PTX ISA layout:
    A row-major a0..a7, B col-major b0..b3, C c0..c3) and multiplied in float64."""
    K = words.shape[1] * 8
    M = x.shape[0]
    xp = np.zeros((8, K))
    xp[:M] = x
    acc = np.zeros((32, 4))
    for ch in range(K // 128):
        for wd in range(4):
            for h in range(2):
                A = np.full((16, 16), np.nan)
                B = np.full((16, 8), np.nan)
                for lane in range(32):
                    g, q = lane // 4, lane % 4
                    k0 = ch * 128 + 32 * q
                    for r, row in ((0, g), (1, g + 8)):
                        word = int(words[row, k0 // 8 + wd])
                        sc, bi = scales[row, k0 // group_size], biases[row, k0 // group_size]
                        for half, shift in ((0, 8 * h), (1, 8 * h + 4)):
                            v = word >> shift
                            lo, hi = v & 0xF, (v >> 16) & 0xF
                            col = 2 * q + 8 * half
                            A[row, col], A[row, col + 1] = sc * lo + bi, sc * hi + bi
                    # x's 8 values of word wd; b0 b1 = (x0, x4) / (x2, x6), b2 b3 = (x1, x5) / (x3, x7)
                    xs = xp[g, k0 + 8 * wd:k0 + 8 * wd + 8]
                    B[2 * q, g], B[2 * q + 1, g] = xs[2 * h], xs[2 * h + 4]
                    B[2 * q + 8, g], B[2 * q + 9, g] = xs[2 * h + 1], xs[2 * h + 5]
                D = A @ B
                for lane in range(32):
                    g, q = lane // 4, lane % 4
                    acc[lane] += [D[g, 2 * q], D[g, 2 * q + 1], D[g + 8, 2 * q], D[g + 8, 2 * q + 1]]
    out = np.zeros((8, 16))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        out[2 * q, g], out[2 * q + 1, g] = acc[lane, 0], acc[lane, 1]
        out[2 * q, g + 8], out[2 * q + 1, g + 8] = acc[lane, 2], acc[lane, 3]
    return out[:M]


def diag_mirror(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, x: np.ndarray,
                group_size: int, diag_lane=lambda g: g // 2) -> np.ndarray:
    """What the one kernel's 4-bit dot (`mega_qdot4_mma`, cuda/mega_device.cuh) computes for
    one pair of weight rows and one input row, lane by lane: words [2, K/8] uint32, scales /
    biases [2, K/GS], x [K] -> [2]. Lane l dequantizes its 32 values of each row to the pairs
    (8w + j, 8w + j + 4) and pairs its inputs the same way; each mma.m16n8k16 takes the lane's
    pairs as its A fragment (row g: weight row 0, row g + 8: weight row 1) and B fragment
    (column g), and after the last one the lane (g, diag_lane(g)) holds D[g][g] and
    D[g + 8][g]: their sum over g is the dot (float64 here)."""
    K = words.shape[1] * 8
    c = np.zeros((32, 4))
    for it in range(K // 1024):
        frag_a = np.zeros((32, 2, 16, 2))     # lane, weight row, pair, (lo, hi)
        frag_b = np.zeros((32, 16, 2))
        for lane in range(32):
            k0 = (it * 32 + lane) * 32
            for w in range(4):
                for j in range(4):
                    e = k0 + 8 * w + j
                    for r in range(2):
                        word = int(words[r, e // 8]) >> (4 * j)
                        sc, bi = scales[r, k0 // group_size], biases[r, k0 // group_size]
                        frag_a[lane, r, 4 * w + j] = sc * (word & 0xF) + bi, sc * ((word >> 16) & 0xF) + bi
                    frag_b[lane, 4 * w + j] = x[e], x[e + 4]
        for i in range(8):                     # mma i: pairs 2i (columns 2q, 2q+1), 2i+1 (2q+8, 2q+9)
            A = np.zeros((16, 16))
            B = np.zeros((16, 8))
            for lane in range(32):
                g, q = lane // 4, lane % 4
                for r in range(2):
                    A[g + 8 * r, 2 * q:2 * q + 2] = frag_a[lane, r, 2 * i]
                    A[g + 8 * r, 2 * q + 8:2 * q + 10] = frag_a[lane, r, 2 * i + 1]
                B[2 * q:2 * q + 2, g] = frag_b[lane, 2 * i]
                B[2 * q + 8:2 * q + 10, g] = frag_b[lane, 2 * i + 1]
            D = A @ B
            for lane in range(32):
                g, q = lane // 4, lane % 4
                c[lane] += [D[g, 2 * q], D[g, 2 * q + 1], D[g + 8, 2 * q], D[g + 8, 2 * q + 1]]
    out = np.zeros(2)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        if q == diag_lane(g):
            out += [c[lane, g % 2], c[lane, 2 + g % 2]]
    return out
