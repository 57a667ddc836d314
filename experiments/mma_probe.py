"""Does a tensor-core batched GEMV pay on the H200? A probe for the batch lane at 8-32 rows.

The batch lane's projections at B rows read each weight once for all rows, but multiply on
the CUDA cores with every row's input read from shared memory per 16-byte weight load: at
8 rows the one-kernel step is bound by those reads, at 32 rows the step of separate kernels
reaches only 1.33x BatchGenerator. This probe times, for projection shapes of the 1b and 8b
presets and B in 1, 8, 16, 32, a GEMV on the tensor cores against MLX's own matmul (what the
L1 batch step runs) and the weight-read floor:

- a block takes tiles of 16 weight rows; its WARPS warps split K, each lane reading 16 bytes
  of two weight rows (g and g + 8, g = lane / 4) per 32 columns and 16 bytes of input row g of
  each group of 8 batch rows, then two `mma.m16n8k16` (bf16 in, float accumulate). The lanes'
  16-byte reads do not follow the instruction's fragment layout, so the 32 columns are taken
  in a permuted order — the same permutation for weights and inputs, which a dot product
  does not see (`--selftest` checks this mapping in numpy, on the CPU);
- the warps' partial sums are added in shared memory, rounded once to bf16.

    python experiments/mma_probe.py --selftest          # CPU: the fragment mapping
    python experiments/mma_probe.py --out DIR           # GPU: correctness and timing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SOURCE = r"""
  // y[b][n] = sum_k W[n][k] x[b][k]; a block per 16-row tile (looping), WARPS warps split K
  constexpr int NT = (B + 7) / 8;                  // groups of 8 batch rows
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  __shared__ float red[WARPS][NT * 128];
  for (int tile = blockIdx.x; tile < N / 16; tile += gridDim.x) {
    const int row0 = tile * 16;
    float c[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
    const T* w0 = W + (size_t)(row0 + g) * K + 8 * t;
    const T* w1 = w0 + (size_t)8 * K;
#pragma unroll 4
    for (int kb = warp * 32; kb < K; kb += WARPS * 32) {
      const uint4 lo = __ldg(reinterpret_cast<const uint4*>(w0 + kb));
      const uint4 hi = __ldg(reinterpret_cast<const uint4*>(w1 + kb));
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int n = 8 * j + g;
        const uint4 bx = n < B ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)n * K + kb + 8 * t))
                               : make_uint4(0u, 0u, 0u, 0u);
        // columns kb+8t+{0,1} / +{2,3} as the fragment's k = 2t+{0,1} / 2t+8+{0,1}; then +4..7
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                     : "r"(lo.x), "r"(hi.x), "r"(lo.y), "r"(hi.y), "r"(bx.x), "r"(bx.y));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                     : "r"(lo.z), "r"(hi.z), "r"(lo.w), "r"(hi.w), "r"(bx.z), "r"(bx.w));
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][j * 128 + lane * 4 + e] = c[j][e];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 128; i += WARPS * 32) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red[w][i];
      const int j = i / 128, ln = (i / 4) % 32, e = i % 4;
      // accumulator e of lane ln: weight row (ln / 4) + 8 * (e / 2), batch row 2 * (ln % 4) + e % 2
      const int row = row0 + (ln >> 2) + ((e >> 1) << 3), n = 8 * j + 2 * (ln & 3) + (e & 1);
      if (n < B) y[(size_t)n * N + row] = T(s);
    }
    __syncthreads();
  }
"""

SHAPES = {  # name: (N rows, K columns)
    "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192),
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
}


def mirror(W: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's lane arithmetic for one 16-row tile, in numpy: each lane's 16-byte reads
    placed into mma.m16n8k16 fragments (PTX ISA layout for .bf16 A row-major / B col-major /
    f32 C), the instruction's product formed from the fragments, the accumulators read back.
    W [16, K], x [B, K] (B <= 8, K a multiple of 32) -> y [B, 16]."""
    K, B = W.shape[1], x.shape[0]
    xp = np.zeros((8, K), np.float64)
    xp[:B] = x
    acc = np.zeros((32, 4))                        # per lane c0..c3
    for kb in range(0, K, 32):
        for half in (0, 1):                        # the two mma of a 32-column step
            A = np.full((16, 16), np.nan)
            Bm = np.full((16, 8), np.nan)
            for lane in range(32):
                g, t = lane // 4, lane % 4
                base = kb + 8 * t + 4 * half       # this lane's 4 columns of this mma
                lo, hi, bx = W[g, base:base + 4], W[g + 8, base:base + 4], xp[g, base:base + 4]
                # a0: (g, 2t..2t+1), a1: (g+8, 2t..), a2: (g, 2t+8..), a3: (g+8, 2t+8..)
                A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = lo[:2], hi[:2]
                A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = lo[2:], hi[2:]
                # b0: (k 2t..2t+1, n g), b1: (k 2t+8.., n g)
                Bm[2 * t:2 * t + 2, g], Bm[2 * t + 8:2 * t + 10, g] = bx[:2], bx[2:]
            assert not np.isnan(A).any() and not np.isnan(Bm).any()   # every element placed once
            D = A @ Bm
            for lane in range(32):
                g, t = lane // 4, lane % 4
                acc[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
    y = np.zeros((8, 16))
    for lane in range(32):
        for e in range(4):
            y[2 * (lane % 4) + e % 2, lane // 4 + 8 * (e // 2)] = acc[lane, e]
    return y[:B]


def selftest() -> int:
    rng = np.random.default_rng(0)
    for B in (1, 5, 8):
        W, x = rng.standard_normal((16, 96)), rng.standard_normal((B, 96))
        got, want = mirror(W, x), x @ W.T
        err = float(np.abs(got - want).max())
        print(json.dumps({"selftest_B": B, "max_abs_err": err}))
        if err > 1e-9:
            return 1
    return 0


def run_gpu(out: Path, batches, trials: int, blocks_per_sm: int, warps: int) -> int:
    import mlx.core as mx

    from engine.fast import kernels as KR
    from engine.fast.mega import sm_count

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    kern = {}
    sms = sm_count() or 132
    for name, (N, K) in SHAPES.items():
        # enough weight copies that a pass reads HBM, not the 50 MB L2
        copies = max(1, -(-200 * 2**20 // (N * K * 2)))
        Ws = [(mx.random.normal((N, K)) * 0.02).astype(mx.bfloat16) for _ in range(copies)]
        for B in batches:
            x = mx.random.normal((B, K)).astype(mx.bfloat16)
            key = (N, K, B)
            if key not in kern:
                kern[key] = KR.cuda_kernel(f"mma_probe_{N}_{K}_{B}_{warps}", ["W", "x"], ["y"], SOURCE)

            def ours(W, x=x, B=B, N=N, K=K):
                return kern[(N, K, B)](inputs=[W, x], template=[("T", mx.bfloat16), ("N", N), ("K", K),
                                                                  ("B", B), ("WARPS", warps)],
                                       grid=(sms * blocks_per_sm * warps * 32, 1, 1),
                                       threadgroup=(warps * 32, 1, 1), output_shapes=[(B, N)],
                                       output_dtypes=[mx.bfloat16])[0]

            def stock(W, x=x):
                return x @ W.T
            ref = (x.astype(mx.float32) @ Ws[0].astype(mx.float32).T)
            got = ours(Ws[0]).astype(mx.float32)
            rel = float(mx.abs(got - ref).max() / mx.abs(ref).max())
            res = {"shape": name, "N": N, "K": K, "B": B, "rel_err": rel}
            for label, fn in (("mma", ours), ("mlx", stock)):
                reps = 8 * copies
                mx.eval([fn(Ws[i % copies]) for i in range(copies)])          # warm-up
                ts = []
                for _ in range(trials):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    mx.eval([fn(Ws[i % copies]) for i in range(reps)])
                    mx.synchronize()
                    ts.append((time.perf_counter() - t0) / reps)
                us = float(np.median(ts)) * 1e6
                res[f"{label}_us"] = round(us, 2)
                res[f"{label}_tb_s"] = round(N * K * 2 / (us * 1e-6) / 1e12, 2)
            res["floor_us"] = round(N * K * 2 / 4.3e12 * 1e6, 2)
            res["mma_vs_mlx"] = round(res["mlx_us"] / res["mma_us"], 3)
            print(json.dumps(res), flush=True)
            rows.append(res)
    (out / "mma_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = [r for r in rows if not r["rel_err"] < 2e-2]
    print(json.dumps({"shapes": len(rows), "wrong": len(bad), "device": str(mx.default_device())}))
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--selftest", action="store_true", help="CPU: the fragment mapping in numpy")
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--blocks-per-sm", type=int, default=2)
    ap.add_argument("--warps", type=int, default=8)
    a = ap.parse_args(argv)
    if a.selftest:
        return selftest()
    if not a.out:
        ap.error("--out DIR (on a GPU), or --selftest")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    return run_gpu(Path(a.out), [int(b) for b in a.batches.split(",")], a.trials, a.blocks_per_sm,
                   a.warps)


if __name__ == "__main__":
    raise SystemExit(main())
