"""Check each fused decode kernel against its stock-MLX reference on the GPU, and time both.

Fresh random inputs per trial (never zeros); relative error ‖kernel − ref‖ / ‖ref‖ in
float32; a kernel passes under 1e-2 (bf16 operands) with no NaN. Timing: median of
`--reps` back-to-back calls of each, synchronized, after a warm-up.

    python experiments/l3_kernel_check.py [--out FILE.json]

Prints one JSON line per check and a summary; the summary's `failed` list is the
value for $MLXP_DISABLE_KERNELS (switch those kernels off, keep the rest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast import gemv as G  # noqa: E402
from engine.fast import kernels as K  # noqa: E402

TOL = 1e-2


def _rel(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def _time(fn, reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def _time_stream(fn, n: int = 40, reps: int = 5) -> float:
    """Microseconds per call when `n` calls run back to back in one graph (what a decode
    step does; the calls' launches overlap), median of reps."""
    mx.eval([fn() for _ in range(2)])
    ts = []
    for _ in range(reps):
        outs = [fn() for _ in range(n)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e6 * sorted(ts)[reps // 2] / n


# (name, N, K, epilogue) of the 1B (hidden 2048, MLP 8192) and 8B (4096, 14336) shapes
GEMV_SHAPES = [("1b qkv", 3072, 2048, "norm"), ("1b o", 2048, 2048, "residual"),
               ("1b gate_up", 16384, 2048, "silu"), ("1b down", 2048, 8192, "residual"),
               ("1b head", 128256, 2048, "norm"),
               ("8b qkv", 6144, 4096, "norm"), ("8b o", 4096, 4096, "residual"),
               ("8b gate_up", 28672, 4096, "silu"), ("8b down", 4096, 14336, "residual")]


def gemv_cases(dt=mx.bfloat16, batches=(1, 8), shapes=GEMV_SHAPES):
    """GEMV checks: (case, fn(use_kernel), weight bytes)."""
    out = []
    for name, N, Kd, epi in shapes:
        lin = nn.Linear(Kd, N, bias=False)
        lin.weight = (0.02 * mx.random.normal((N, Kd))).astype(dt)
        mod, nbytes = lin, lin.weight.nbytes
        nw = (1 + 0.1 * mx.random.normal((Kd,))).astype(dt)
        for B in batches:
            x = mx.random.normal((B, 1, Kd)).astype(dt)
            res = mx.random.normal((B, 1, N)).astype(dt) if epi == "residual" else None
            kw = dict(norm=(nw, 1e-5) if epi in ("norm", "silu") else None, residual=res,
                      silu_split=N // 2 if epi == "silu" else None)
            out.append((f"{name} B{B}",
                        lambda u, mod=mod, x=x, kw=kw: (G.linear(mod, x, use_kernel=u, **kw),), nbytes))
    return out


def cases(dt=mx.bfloat16):
    """(kernel name, case name, fn(use_kernel) -> tuple of outputs)."""
    out = []
    for D in (2048, 4096):
        x, r = mx.random.normal((1, 1, D)).astype(dt), mx.random.normal((1, 1, D)).astype(dt)
        w = (1 + 0.1 * mx.random.normal((D,))).astype(dt)
        out.append(("add_rms", f"D{D}", lambda u, x=x, r=r, w=w: K.add_rms_norm(x, r, w, 1e-5, u)))
    for H, Hkv, hd in ((32, 8, 64), (32, 8, 128)):
        rope = nn.RoPE(hd, base=500000.0)
        inv = K.rope_inv_freq(rope, hd)
        for p in (0, 77, 2047):
            qkv = mx.random.normal((1, 1, (H + 2 * Hkv) * hd)).astype(dt)
            pos = mx.array([p], dtype=mx.int32)
            out.append(("rope_qkv", f"H{H}/{Hkv} d{hd} pos{p}",
                        lambda u, qkv=qkv, pos=pos, H=H, Hkv=Hkv, hd=hd, rope=rope, inv=inv:
                        K.rope_qkv(qkv, inv, pos, H, Hkv, hd, rope, u)))
            # the q/k/v GEMV with RoPE in its epilogue (engine.fast.gemv.qkv_rope)
            Kd = 2048
            lin = nn.Linear(Kd, (H + 2 * Hkv) * hd, bias=False)
            lin.weight = (0.02 * mx.random.normal(lin.weight.shape)).astype(dt)
            nw = (1 + 0.1 * mx.random.normal((Kd,))).astype(dt)
            xh = mx.random.normal((1, 1, Kd)).astype(dt)

            def fused(u, lin=lin, xh=xh, nw=nw, pos=pos, H=H, Hkv=Hkv, hd=hd, rope=rope, inv=inv):
                if u:
                    return G.qkv_rope(lin, xh, (nw, 1e-5), inv, pos, H, Hkv, hd)
                return K.rope_qkv(G.linear(lin, xh, norm=(nw, 1e-5)), inv, pos, H, Hkv, hd, rope, False)
            out.append(("rope_qkv", f"gemv+rope H{H}/{Hkv} d{hd} pos{p}", fused))
            if p == 77:                  # rows of the batch at their own positions
                x4 = mx.random.normal((4, 1, Kd)).astype(dt)
                p4 = mx.array([0, 5, 77, 2047], dtype=mx.int32)

                def fused4(u, lin=lin, x4=x4, nw=nw, p4=p4, H=H, Hkv=Hkv, hd=hd, rope=rope, inv=inv):
                    if u:
                        return G.qkv_rope(lin, x4, (nw, 1e-5), inv, p4, H, Hkv, hd)
                    return K.rope_qkv(G.linear(lin, x4, norm=(nw, 1e-5)), inv, p4, H, Hkv, hd, rope, False)
                out.append(("rope_qkv", f"gemv+rope B4 per-row H{H}/{Hkv} d{hd}", fused4))
        for cap, n in ((256, 1), (256, 129), (512, 400), (2560, 2049), (2560, 2560)):
            q = mx.random.normal((1, H, 1, hd)).astype(dt)
            k = mx.random.normal((1, Hkv, cap, hd)).astype(dt)
            v = mx.random.normal((1, Hkv, cap, hd)).astype(dt)
            ln = mx.array([n], dtype=mx.int32)
            out.append(("attention", f"H{H}/{Hkv} d{hd} cap{cap} len{n}",
                        lambda u, q=q, k=k, v=v, ln=ln, hd=hd:
                        (K.decode_attention(q, k, v, ln, hd ** -0.5, u),)))
        out += batch_cases(H, Hkv, hd, rope, inv, dt)
    return out


def batch_cases(H, Hkv, hd, rope, inv, dt):
    """Rows of the batch (--fast-batch): one RoPE position per row, and attention from a
    start column per row (its left padding) to the shared length."""
    out = []
    pos = mx.array([0, 5, 130, 2047, 77, 1, 999, 64], dtype=mx.int32)
    qkv = mx.random.normal((8, 1, (H + 2 * Hkv) * hd)).astype(dt)
    out.append(("rope_qkv", f"H{H}/{Hkv} d{hd} B8 per-row pos",
                lambda u, qkv=qkv: K.rope_qkv(qkv, inv, pos, H, Hkv, hd, rope, u)))
    for cap, n, starts in ((512, 130, [0, 3, 129, 64, 100, 7, 0, 1]),
                           (2560, 2049, [0, 2000, 1024, 5, 2048, 900, 17, 1500])):
        B = len(starts)
        q = mx.random.normal((B, H, 1, hd)).astype(dt)
        k = mx.random.normal((B, Hkv, cap, hd)).astype(dt)
        v = mx.random.normal((B, Hkv, cap, hd)).astype(dt)
        ln, st = mx.array([n], dtype=mx.int32), mx.array(starts, dtype=mx.int32)
        out.append(("attention", f"H{H}/{Hkv} d{hd} B{B} cap{cap} len{n} per-row start",
                    lambda u, q=q, k=k, v=v, ln=ln, st=st:
                    (K.decode_attention(q, k, v, ln, hd ** -0.5, u, start=st),)))
    return out


def _check_projection(kname: str, case: str, fn, nbytes: int, tol: float) -> dict:
    """One GEMV case: error against the stock ops, and both timed back to back."""
    row = {"kernel": kname, "case": case}
    try:
        got, ref = fn(True), fn(False)
        mx.eval(got, ref)
        row["rel_err"] = max(_rel(g, r) for g, r in zip(got, ref))
        row["ok"] = row["rel_err"] < tol
        row["kernel_us"] = _time_stream(lambda: fn(True)[0])
        row["reference_us"] = _time_stream(lambda: fn(False)[0])
        row["kernel_tb_s"] = nbytes / row["kernel_us"] / 1e6
        row["reference_tb_s"] = nbytes / row["reference_us"] / 1e6
    except Exception as e:                          # a compile or launch error
        row["ok"] = False
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    return row


def _save(out, rows, failed, done: bool) -> None:
    """The results so far (rewritten after every check, so a run cut short by a time limit
    still says which kernels passed; `done` is false until every check ran)."""
    if out:
        checked = sorted({r["kernel"] for r in rows})
        summary = {"checks": len(rows), "failed": sorted(failed), "checked": checked, "done": done,
                   "device": str(mx.default_device())}
        Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    mx.random.seed(0)
    rows, failed = [], set()
    if not K.cuda_available():
        print(json.dumps({"error": "no CUDA device: the kernels run on an NVIDIA GPU only"}))
        return 2
    for kname, case, fn in cases():
        row = {"kernel": kname, "case": case}
        try:
            got, ref = fn(True), fn(False)
            mx.eval(got, ref)
            errs = [_rel(g, r) for g, r in zip(got, ref)]
            row["rel_err"] = max(errs)
            row["ok"] = all(e < TOL for e in errs)       # NaN compares False: fails
            row["kernel_us"] = _time(lambda: fn(True), a.reps)
            row["reference_us"] = _time(lambda: fn(False), a.reps)
        except Exception as e:                          # a compile or launch error
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        if not row["ok"]:
            failed.add(kname)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _save(a.out, rows, failed, done=False)
    for kname, tol, projections in (("gemv", TOL, gemv_cases()),):
        for case, fn, nbytes in projections:
            row = _check_projection(kname, case, fn, nbytes, tol)
            if not row["ok"]:
                failed.add(kname)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _save(a.out, rows, failed, done=False)
    _save(a.out, rows, failed, done=True)
    print(json.dumps({"checks": len(rows), "failed": sorted(failed), "done": True,
                      "device": str(mx.default_device())}))
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
