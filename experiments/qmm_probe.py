"""The 4-bit tensor-core projections (engine.fast.qmm) against MLX's quantized matmul, on a GPU.

For the projection shapes of the 1b and 8b presets (affine 4-bit, group 64) and each row count,
`qmm.linear` against `mx.quantized_matmul` (what the fast step ran for these rows before, and
what mlx-lm runs): the relative error of ours against a float32 product of MLX's dequantized
weights, and the time of back-to-back calls over enough weight copies that a pass reads HBM
(median of --trials). `--configs` times launch layouts (`warps:unroll:min_warps`) on the 8b
shapes at --sweep-rows rows.

    python experiments/qmm_probe.py --out DIR [--rows 1,8,16,32] [--configs 8:2:4096,4:2:4096]

Prints a JSON line a case and writes DIR/qmm_probe.jsonl; exits 1 when a case is wrong
(relative error over 2e-2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (N rows, K columns, epilogue: 0 plain, 1 residual, 2 SiLU·up of N/2)
    "1b.qkv": (3072, 2048, 0), "1b.o": (2048, 2048, 1), "1b.gate_up": (16384, 2048, 2),
    "1b.down": (2048, 8192, 1), "8b.qkv": (6144, 4096, 0), "8b.o": (4096, 4096, 1),
    "8b.gate_up": (28672, 4096, 2), "8b.down": (4096, 14336, 1), "8b.head": (128256, 4096, 0),
}


def _time(fn, args_list, trials):
    import mlx.core as mx
    mx.eval([fn(*a) for a in args_list])                      # warm-up (and compile)
    reps = max(8, 4 * len(args_list))
    ts = []
    for _ in range(trials):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn(*args_list[i % len(args_list)]) for i in range(reps)])
        mx.synchronize()
        ts.append((time.perf_counter() - t0) / reps)
    return float(np.median(ts)) * 1e6


def diagnose() -> dict:
    """One tile (N 16, K 128, 8 rows): where ours differs from the dequantized product — the
    batch rows and weight rows off, and the error — so that a wrong mapping shows its pattern."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.fast import qmm as Q
    mx.random.seed(0)
    lin = nn.QuantizedLinear(128, 16, bias=False, group_size=64, bits=4)
    lin.update({"scales": lin.scales.astype(mx.bfloat16), "biases": lin.biases.astype(mx.bfloat16)})
    x = mx.random.normal((8, 128)).astype(mx.bfloat16)
    wf = mx.dequantize(lin.weight, lin.scales.astype(mx.float32), lin.biases.astype(mx.float32), 64, 4)
    ref = np.array(x.astype(mx.float32) @ wf.T)
    got = np.array(Q.linear(lin, x).astype(mx.float32))
    err = np.abs(got - ref) > 2e-2 * np.abs(ref).max()
    return {"diagnose_max_rel": float(np.abs(got - ref).max() / np.abs(ref).max()),
            "bad_batch_rows": np.nonzero(err.any(1))[0].tolist(),
            "bad_weight_rows": np.nonzero(err.any(0))[0].tolist(),
            "got_row0": np.round(got[0], 3).tolist(), "ref_row0": np.round(ref[0], 3).tolist()}


def run(out: Path, rows_list, trials, configs, sweep_rows) -> int:
    import mlx.core as mx
    import mlx.nn as nn

    from engine.fast import qmm as Q

    out.mkdir(parents=True, exist_ok=True)
    d = diagnose()
    print(json.dumps(d), flush=True)
    (out / "diagnose.json").write_text(json.dumps(d))
    if d["bad_batch_rows"]:
        return 1
    results = []
    for name, (N, K, epi) in SHAPES.items():
        wbytes = N * K // 2 + 2 * N * (K // 64) * 2
        copies = max(1, -(-200 * 2**20 // wbytes))
        mods = []
        for _ in range(copies):
            lin = nn.QuantizedLinear(K, N, bias=False, group_size=64, bits=4)
            lin.update({"weight": lin.weight, "scales": lin.scales.astype(mx.bfloat16),
                        "biases": lin.biases.astype(mx.bfloat16)})
            mods.append(lin)
        mx.eval([m.parameters() for m in mods])
        wf = mx.dequantize(mods[0].weight, mods[0].scales, mods[0].biases, 64, 4).astype(mx.float32)
        cfgs = [Q.DEFAULT] + ([Q.QmmConfig(*c) for c in configs] if name.startswith("8b") else [])
        for M in rows_list:
            x = (mx.random.normal((M, K)) * 0.5).astype(mx.bfloat16)
            half = N // 2
            res = (mx.random.normal((M, N if epi != 2 else half))).astype(mx.bfloat16)

            def ours(m, cfg=Q.DEFAULT, x=x, res=res):
                if epi == 2:
                    return Q.linear(m, x, silu_split=half, config=cfg)
                return Q.linear(m, x, residual=res if epi == 1 else None, config=cfg)

            def stock(m, x=x, res=res):
                y = mx.quantized_matmul(x, m.weight, m.scales, m.biases, transpose=True, group_size=64, bits=4)
                if epi == 2:
                    g, u = mx.split(y, [half], axis=-1)
                    return nn.silu(g) * u
                return res + y if epi == 1 else y
            ref = x.astype(mx.float32) @ wf.T
            if epi == 2:
                g, u = mx.split(ref, [half], axis=-1)
                ref = nn.silu(g) * u
            elif epi == 1:
                ref = res.astype(mx.float32) + ref
            got = ours(mods[0]).astype(mx.float32)
            rel = float(mx.abs(got - ref).max() / mx.abs(ref).max())
            st = stock(mods[0]).astype(mx.float32)
            rel_mlx = float(mx.abs(st - ref).max() / mx.abs(ref).max())
            t_mlx = _time(stock, [(m,) for m in mods], trials)
            for cfg in cfgs:
                if cfg is not Q.DEFAULT and M != sweep_rows:
                    continue
                t_ours = _time(lambda m, c=cfg: ours(m, c), [(m,) for m in mods], trials)
                r = {"shape": name, "N": N, "K": K, "rows": M, "config": [cfg.warps, cfg.unroll, cfg.min_warps],
                     "rel_err": round(rel, 5), "mlx_rel_err": round(rel_mlx, 5),
                     "qmm_us": round(t_ours, 2), "mlx_us": round(t_mlx, 2),
                     "qmm_tb_s": round(wbytes / (t_ours * 1e-6) / 1e12, 3),
                     "mlx_tb_s": round(wbytes / (t_mlx * 1e-6) / 1e12, 3),
                     "speedup": round(t_mlx / t_ours, 3)}
                print(json.dumps(r), flush=True)
                results.append(r)
    (out / "qmm_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    bad = [r for r in results if not r["rel_err"] < 2e-2]
    print(json.dumps({"cases": len(results), "wrong": len(bad), "device": str(mx.default_device())}))
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--configs", default="", help="warps:unroll:min_warps,... (8b shapes, --sweep-rows)")
    ap.add_argument("--sweep-rows", type=int, default=16)
    a = ap.parse_args(argv)
    configs = [tuple(int(v) for v in c.split(":")) for c in a.configs.split(",") if c]
    return run(Path(a.out), [int(r) for r in a.rows.split(",")], a.trials, configs, a.sweep_rows)


if __name__ == "__main__":
    raise SystemExit(main())
