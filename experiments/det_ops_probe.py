"""Deterministic mode's ops against the stock ones, one by one, on the GPU (issue #41's cost).

For 1B-shaped layers (bf16, 32 heads, 8 KV heads, head dim 64, hidden 2048, MLP 8192, vocab
128256) at 1, 8 and 32 decode rows: the batch-invariant attention kernel against MLX's
attention (boolean left-padding mask, as a batch decode step has), each blocked projection
against the stock one, and a whole layer's worth of each. Two timings per op: `lat_us` (one
call, then wait: what a step that waits pays) and `thr_us` (20 calls queued, then wait: the
GPU's own time per call). `_det`: a cuBLAS call per 64-row block; `_gather`: every block in one
`mx.gather_mm` (engine.fast.invariant.gathered).

    python experiments/det_ops_probe.py [--rows 1,8,32] [--keys 640] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from engine.fast import invariant  # noqa: E402
from engine.kv.masks import causal_mask  # noqa: E402


def timed(fn, reps: int = 20):
    mx.eval(fn())
    mx.synchronize()
    lat = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [fn() for _ in range(reps)]
    mx.eval(outs)
    mx.synchronize()
    thr = (time.perf_counter() - t) / reps
    return round(sorted(lat)[2] * 1e6, 1), round(thr * 1e6, 1)


def quantized_gather(bits: int = 4, group: int = 64) -> dict:
    """A candidate for 4-bit weights (not in the engine): every 64-row block in one
    `mx.gather_qmm` call instead of a quantized matmul per block. Whether a row gives the same
    bits alone and among 5 / 200 / 2048 rows, and its time against the per-block form at 2048."""
    lin = nn.QuantizedLinear.from_linear(nn.Linear(2048, 8192, bias=False), group_size=group, bits=bits)
    lin.set_dtype(mx.bfloat16)

    def gq(x):
        k = x.shape[-1]
        n = x.size // k
        pad = -n % invariant.ROWS
        nb = (n + pad) // invariant.ROWS
        rows = mx.pad(x.reshape(-1, k), ((0, pad), (0, 0))).reshape(nb, invariant.ROWS, k)
        out = mx.gather_qmm(rows, lin.weight[None], lin.scales[None], lin.biases[None],
                            mx.arange(nb, dtype=mx.uint32), mx.zeros((nb,), mx.uint32),
                            transpose=True, group_size=group, bits=bits)
        return out.reshape(nb * invariant.ROWS, -1)[:n]
    row = mx.random.normal((1, 2048)).astype(mx.bfloat16)
    res = {"q4_gather": {}}
    alone = gq(row)
    for n, at in ((5, 3), (200, 130), (2048, 1500)):
        x = mx.random.normal((n, 2048)).astype(mx.bfloat16)
        x[at:at + 1] = row
        res["q4_gather"][f"equal_{n}"] = bool(mx.array_equal(gq(x)[at:at + 1], alone).item())
    x = mx.random.normal((2048, 2048)).astype(mx.bfloat16)
    mx.eval(x)
    res["q4_gather"]["gather_2048"] = timed(lambda: gq(x), reps=5)
    res["q4_gather"]["blocked_2048"] = timed(lambda: invariant.blocked(lin, x), reps=5)
    res["q4_gather"]["stock_2048"] = timed(lambda: lin(x), reps=5)
    for n in (1, 32):                 # decode rows: one block either way
        x = mx.random.normal((n, 2048)).astype(mx.bfloat16)
        mx.eval(x)
        res["q4_gather"][f"gather_{n}"] = timed(lambda: gq(x))
        res["q4_gather"][f"blocked_{n}"] = timed(lambda: invariant.blocked(lin, x))
        res["q4_gather"][f"stock_{n}"] = timed(lambda: lin(x))
    print(json.dumps(res), flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--keys", type=int, default=640)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dt, H, Hkv, D, L = mx.bfloat16, 32, 8, 64, a.keys
    rows_out = []
    lin = {name: nn.Linear(i, o, bias=False) for name, (i, o) in
           {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384),
            "down": (8192, 2048), "head": (2048, 128256)}.items()}
    for m in lin.values():
        m.set_dtype(dt)
    mx.eval([m.parameters() for m in lin.values()])
    for B in [int(r) for r in a.rows.split(",")]:
        q = mx.random.normal((B, H, 1, D)).astype(dt)
        k = mx.random.normal((B, Hkv, L, D)).astype(dt)
        v = mx.random.normal((B, Hkv, L, D)).astype(dt)
        mask = causal_mask(1, L - 1, left_padding=mx.array([(7 * b) % 50 for b in range(B)]))
        mx.eval(q, k, v, mask)
        scale = D ** -0.5
        res = {"rows": B, "keys": L}
        invariant._LAST.clear()
        res["attn_det"] = timed(lambda: invariant.attention(q, k, v, scale, mask))
        res["attn_stock"] = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                                mask=mask))
        for name, m in lin.items():
            x = mx.random.normal((B, 1, m.weight.shape[1])).astype(dt)
            mx.eval(x)
            res[f"{name}_stock"] = timed(lambda: m(x))
            res[f"{name}_det"] = timed(lambda: invariant.blocked(m, x))      # a cuBLAS call a block
            res[f"{name}_gather"] = timed(lambda: invariant.gathered(m.weight, x))  # one gather_mm
        x = mx.random.normal((B, 1, 2048)).astype(dt)
        mx.eval(x)
        res["pad"] = timed(lambda: mx.pad(x.reshape(-1, 2048), ((0, 64 - B % 64 if B % 64 else 0), (0, 0))))
        print(json.dumps(res), flush=True)
        rows_out.append(res)
    pre = {"prefill_rows": 2048}          # a prefill chunk's projections
    for name in ("qkv", "down"):
        m = lin[name]
        x = mx.random.normal((1, 2048, m.weight.shape[1])).astype(dt)
        mx.eval(x)
        pre[f"{name}_stock"] = timed(lambda: m(x), reps=5)
        pre[f"{name}_det"] = timed(lambda: invariant.blocked(m, x), reps=5)
        pre[f"{name}_gather"] = timed(lambda: invariant.gathered(m.weight, x), reps=5)
    print(json.dumps(pre), flush=True)
    rows_out.append(pre)
    try:
        rows_out.append(quantized_gather())
    except Exception as e:          # (a candidate: its failure is a finding, not the run's end)
        print(json.dumps({"q4_gather": f"failed: {type(e).__name__}: {e}"}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": str(mx.default_device()), "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
