"""Time the fused GEMV's layouts against MLX's own matmul on the decode projections.

For each projection shape of the 1B and 8B presets (and batch rows 1 and 8) this times
MLX's stock ops and every layout of engine.fast.gemv (1/2/4 warps per row and 2/4/8 loads in
flight per lane; warps per row as chosen by shape), each as a stream
of back-to-back calls, as in a decode step. Every call of a stream reads its own copy of
the weights (enough copies to exceed the 50 MB L2 of an H200), so weights come from HBM
as they do in a real step, where each projection's weights are read once per token.

    python experiments/gemv_sweep.py [--out sweep.jsonl] [--batches 1,8] [--quick]

Prints one JSON line per (shape, rows, layout): microseconds per call, TB/s of weights
read, and the ratio to the stock ops measured in the same process; the last line is a
summary: the best layout per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast import gemv as G  # noqa: E402
from engine.fast import kernels as K  # noqa: E402

SHAPES = [("1b qkv", 3072, 2048, "norm"), ("1b o", 2048, 2048, "residual"),
          ("1b gate_up", 16384, 2048, "silu"), ("1b down", 2048, 8192, "residual"),
          ("1b head", 128256, 2048, "norm"),
          ("8b qkv", 6144, 4096, "norm"), ("8b o", 4096, 4096, "residual"),
          ("8b gate_up", 28672, 4096, "silu"), ("8b down", 4096, 14336, "residual")]
L2_BYTES = 50 << 20


def layouts(quick: bool):
    """(name, KSPLIT (0: by shape), UNROLL)."""
    out = [("warp-auto-u4", 0, 4)]
    if not quick:
        for ks in (1, 2, 4):
            for un in (2, 4, 8):
                out.append((f"warp-ks{ks}-u{un}", ks, un))
    return out


def stream_us(fns, reps: int = 5) -> float:
    """Microseconds per call for the calls `fns` run back to back (median of reps)."""
    mx.eval([f() for f in fns])
    ts = []
    for _ in range(reps):
        outs = [f() for f in fns]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e6 * sorted(ts)[reps // 2] / len(fns)


def shape_calls(N, Kd, epi, B, dt):
    """(nbytes, fn(use_kernel) per weight copy)."""
    nbytes = N * Kd * mx.array(0, dt).itemsize
    copies = max(2, min(24, -(-3 * L2_BYTES // nbytes)))
    mods = []
    for _ in range(copies):
        lin = nn.Linear(Kd, N, bias=False)
        lin.weight = (0.02 * mx.random.normal((N, Kd))).astype(dt)
        mods.append(lin)
    mx.eval([m.weight for m in mods])
    x = mx.random.normal((B, 1, Kd)).astype(dt)
    nw = (1 + 0.1 * mx.random.normal((Kd,))).astype(dt)
    res = mx.random.normal((B, 1, N)).astype(dt) if epi == "residual" else None
    kw = dict(norm=(nw, 1e-5) if epi in ("norm", "silu") else None, residual=res,
              silu_split=N // 2 if epi == "silu" else None)
    calls = [lambda u, m=m: G.linear(m, x, use_kernel=u, **kw) for m in mods]
    return nbytes, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shapes", default="", help="substring filter on shape names, comma-separated")
    ap.add_argument("--quick", action="store_true", help="only the by-shape layout")
    a = ap.parse_args(argv)
    if not K.cuda_available():
        print(json.dumps({"error": "no CUDA device: the kernels run on an NVIDIA GPU only"}))
        return 2
    mx.random.seed(0)
    filt = [f for f in a.shapes.split(",") if f]
    saved = (G.KSPLIT, G.UNROLL)
    rows, best = [], {}
    fh = open(a.out, "w") if a.out else None
    for name, N, Kd, epi in SHAPES:
        if filt and not any(f in name for f in filt):
            continue
        for B in [int(b) for b in a.batches.split(",")]:
            nbytes, calls = shape_calls(N, Kd, epi, B, mx.bfloat16)
            stock = stream_us([lambda c=c: c(False) for c in calls] * 2)
            ref = calls[0](False)
            for lname, ks, un in layouts(a.quick):
                G.KSPLIT, G.UNROLL = ks, un
                row = {"shape": name, "rows": B, "layout": lname, "stock_us": round(stock, 2),
                       "stock_tb_s": round(nbytes / stock / 1e6, 3)}
                try:
                    got = calls[0](True)
                    err = (mx.linalg.norm((got - ref).astype(mx.float32).reshape(-1))
                           / mx.linalg.norm(ref.astype(mx.float32).reshape(-1))).item()
                    us = stream_us([lambda c=c: c(True) for c in calls] * 2)
                    row.update(us=round(us, 2), tb_s=round(nbytes / us / 1e6, 3),
                               vs_stock=round(stock / us, 3), rel_err=err, ok=err < 1e-2)
                    key = f"{name} B{B}"
                    if row["ok"] and (key not in best or us < best[key]["us"]):
                        best[key] = {"layout": lname, "us": round(us, 2), "vs_stock": row["vs_stock"]}
                except Exception as e:                   # noqa: BLE001  (a compile or launch error)
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
                if fh:
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
            G.KSPLIT, G.UNROLL = saved
            del calls
    summary = {"best": best, "device": str(mx.default_device())}
    print(json.dumps(summary))
    if fh:
        fh.write(json.dumps({"summary": summary}) + "\n")
        fh.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
