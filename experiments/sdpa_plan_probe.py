"""What a new K/V length costs MLX's CUDA attention for a multi-token query (a cached agent
turn's prefill chunk, a speculation verify), and whether a padded, masked K/V avoids it.

MLX 0.32's CUDA `scaled_dot_product_attention` sends a query of more than one token to cuDNN,
whose plan cache is keyed by the exact shapes (mlx/backend/cuda/scaled_dot_product_attention.cpp:
`build_sdpa_cache_key`): every new K/V length builds a plan. For each of `--turns` K/V lengths
(`--start` + `--step` x turn, as turns of an agent session grow the cache), one call each way,
timed with the device synchronised:

    exact     K/V of the exact length, mask "causal" (what a lone row's prefill passes)
    same      the first length again every time (the plan cached: the kernel's own cost)
    padded    K/V sliced to the length rounded up to `--bucket` columns (the cache buffer's
              tail beyond the real length zeroed), a boolean mask: causal over the real
              columns, False over the padding (one plan a bucket)
    composed  MLX's fallback ops (the scores materialised, no cuDNN; what 0.5.3 ran for
              speculation's forwards)
    bucketed  engine/models/bucketed_sdpa.py (0.5.4: query and K/V padded to buckets, the
              additive mask MLX makes of `padded`'s boolean one, built once: what the engine
              runs on CUDA)
    bcast     the bucketed shapes with the additive mask at [1, 1, Tb, Lb], not materialised
              over the heads (built before the call, as a forward's layers would share it)

and whether `padded`, `composed`, `bucketed` and `bcast` equal `exact` bit for bit (`mx.array_equal`).

    python experiments/sdpa_plan_probe.py [--q 400] [--start 17000] [--turns 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import mlx.core as mx

    from engine.models.bucketed_sdpa import bucket, padded_mask
    from engine.models.bucketed_sdpa import sdpa as bucketed

    def composed(q, k, v, scale, mask):       # MLX's fallback chain (0.5.3's composed_sdpa)
        B, H, T, D = q.shape
        rep = H // k.shape[1]
        qs = (q * scale).reshape(B, k.shape[1], rep, T, D)
        s = qs @ mx.expand_dims(k, 2).swapaxes(-1, -2)
        L = k.shape[2]
        keep = mx.arange(L)[None] <= mx.arange(L - T, L)[:, None]
        s = mx.where(keep, s, mx.finfo(s.dtype).min)
        p = mx.softmax(s, axis=-1, precise=True)
        return (p @ mx.expand_dims(v, 2)).reshape(B, H, T, D)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q", type=int, default=400, help="query tokens (the chunk)")
    ap.add_argument("--start", type=int, default=17000, help="the first K/V length")
    ap.add_argument("--step", type=int, default=400, help="K/V length added a turn")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dt = getattr(mx, a.dtype)
    cap = a.start + a.step * a.turns + a.bucket
    cap = -(-cap // a.bucket) * a.bucket
    kbuf = mx.random.normal((1, a.kv_heads, cap, a.dim)).astype(dt)
    vbuf = mx.random.normal((1, a.kv_heads, cap, a.dim)).astype(dt)
    scale = a.dim ** -0.5

    def timed(fn):
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        mx.synchronize()
        return out, (time.perf_counter() - t0) * 1000

    rows = []
    for t in range(a.turns + 1):           # (turn 0: warm-up, not reported)
        L = a.start + a.step * t
        q = mx.random.normal((1, a.heads, a.q, a.dim)).astype(dt)
        k, v = kbuf[:, :, :L], vbuf[:, :, :L]
        mx.eval(q, k, v)
        exact, t_exact = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                            mask="causal"))
        L0 = a.start
        k0, v0 = kbuf[:, :, :L0], vbuf[:, :, :L0]
        _, t_same = timed(lambda: mx.fast.scaled_dot_product_attention(q, k0, v0, scale=scale,
                                                                      mask="causal"))
        Lb = -(-L // a.bucket) * a.bucket
        kp = mx.concatenate([k, mx.zeros((1, a.kv_heads, Lb - L, a.dim), dt)], axis=2)
        vp = mx.concatenate([v, mx.zeros((1, a.kv_heads, Lb - L, a.dim), dt)], axis=2)
        qi = mx.arange(L - a.q, L)[:, None]
        ki = mx.arange(Lb)[None]
        mask = (ki <= qi)[None, None]
        mx.eval(kp, vp, mask)
        padded, t_pad = timed(lambda: mx.fast.scaled_dot_product_attention(q, kp, vp, scale=scale,
                                                                          mask=mask))
        comp, t_comp = timed(lambda: composed(q, k, v, scale, "causal"))
        buck, t_buck = timed(lambda: bucketed(q, k, v, scale, "causal"))
        # bcast: the bucketed shapes with the additive mask left at [1, 1, Tb, Lb] (built once
        # a forward, outside the timing; not materialised over the heads)
        Tb, Lb2 = bucket(a.q, 16), bucket(L, 256)
        bias = padded_mask("causal", a.q, L, Tb, Lb2, dt)
        qb = mx.concatenate([q, mx.zeros((1, a.heads, Tb - a.q, a.dim), dt)], axis=2)
        kb = mx.concatenate([k, mx.zeros((1, a.kv_heads, Lb2 - L, a.dim), dt)], axis=2)
        vb = mx.concatenate([v, mx.zeros((1, a.kv_heads, Lb2 - L, a.dim), dt)], axis=2)
        mx.eval(bias, qb, kb, vb)
        bc, t_bc = timed(lambda: mx.fast.scaled_dot_product_attention(qb, kb, vb, scale=scale,
                                                                     mask=bias)[:, :, :a.q])
        row = dict(turn=t, kv=L, bucket=Lb, exact_ms=round(t_exact, 2), same_ms=round(t_same, 2),
                   padded_ms=round(t_pad, 2), composed_ms=round(t_comp, 2),
                   bucketed_ms=round(t_buck, 2), bcast_ms=round(t_bc, 2),
                   bcast_equal=bool(mx.array_equal(bc, exact).item()),
                   bucketed_equal=bool(mx.array_equal(buck, exact).item()),
                   padded_equal=bool(mx.array_equal(padded, exact).item()),
                   composed_equal=bool(mx.array_equal(comp, exact).item()),
                   padded_maxdiff=float(mx.abs(padded.astype(mx.float32)
                                               - exact.astype(mx.float32)).max().item()))
        if t:
            rows.append(row)
        print(json.dumps(row), flush=True)
    med = {k: round(statistics.median(r[k] for r in rows), 2)
           for k in ("exact_ms", "same_ms", "padded_ms", "composed_ms", "bucketed_ms", "bcast_ms")}
    summary = dict(device=str(mx.default_device()), mlx=mx.__version__, q=a.q, heads=a.heads,
                   kv_heads=a.kv_heads, dim=a.dim, dtype=a.dtype, bucket=a.bucket, median=med,
                   padded_all_equal=all(r["padded_equal"] for r in rows),
                   bucketed_all_equal=all(r["bucketed_equal"] for r in rows),
                   bcast_all_equal=all(r["bcast_equal"] for r in rows),
                   composed_all_equal=all(r["composed_equal"] for r in rows))
    print(json.dumps(summary), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
