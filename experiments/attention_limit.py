"""Where MLX's fused attention backward stops, and the query-blocked one (train/attention.py).

    python experiments/attention_limit.py --contexts 122880,131072,262144,524288   # H200

One causal attention of the 1B Llama shape (B=1, 32 query heads, 8 KV heads,
head_dim 64, bf16; `--head-dim 128` for the 8B shape): per context, in a fresh
subprocess each, (a) `whole`: the forward and the fused vjp over the whole
sequence, as the segmented backward ran it up to 0.1.2; (b) `blocked<N>`: the
query-blocked forward and vjp with N-row blocks. Reported: ok / the error
message, peak memory (`mx.get_peak_memory()`), median time of forward+backward
over `--steps` runs after one warm-up, and - where both ran - the largest
relative difference of dq / dk / dv between the two (max |a-b| / max |b|).
Writes reports/attention_limit/<version>/<tag>/attention_limit.{csv,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import machine, md_table, report_dir, write_csv  # noqa: E402

FIELDS = ["context", "mode", "status", "peak_gb", "time_s", "rel_dq", "rel_dk", "rel_dv", "error"]


def _inputs(T, H, KV, D, dtype):
    import mlx.core as mx
    keys = mx.random.split(mx.random.key(T), 4)
    q = mx.random.normal((1, H, T, D), key=keys[0]).astype(dtype)
    k = mx.random.normal((1, KV, T, D), key=keys[1]).astype(dtype)
    v = mx.random.normal((1, KV, T, D), key=keys[2]).astype(dtype)
    do = (mx.random.normal((1, H, T, D), key=keys[3]) * 1e-2).astype(dtype)
    mx.eval(q, k, v, do)
    return q, k, v, do


def run_case(spec: dict) -> dict:
    import mlx.core as mx

    from train.attention import Blocking, blocked_attention, blocked_attention_vjp
    T, mode, D = spec["context"], spec["mode"], spec["head_dim"]
    dtype = getattr(mx, spec["dtype"])
    q, k, v, do = _inputs(T, spec["heads"], spec["kv_heads"], D, dtype)
    scale = D ** -0.5

    def whole():
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        mx.eval(o)
        _, g = mx.vjp(lambda a, b, c: [mx.fast.scaled_dot_product_attention(
            a, b, c, scale=scale, mask="causal")], [q, k, v], [do])
        mx.eval(g)
        return g

    def blocked():
        bl = Blocking(int(mode[len("blocked"):]))
        mx.eval(blocked_attention(q, k, v, scale, bl))
        g = blocked_attention_vjp(q, k, v, scale, bl, do)
        mx.eval(g)
        return g

    fn = whole if mode == "whole" else blocked
    out = {"context": T, "mode": mode}
    times, g = [], None
    try:
        for _ in range(spec["steps"] + 1):
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            g = fn()
            mx.synchronize()
            times.append(time.perf_counter() - t0)
    except Exception as e:  # the finding is the error itself
        out.update(status="failed", error=f"{type(e).__name__}: {e}"[:300],
                   peak_gb=mx.get_peak_memory() / 1e9)
        return out
    out.update(status="ok", peak_gb=mx.get_peak_memory() / 1e9,
               time_s=statistics.median(times[1:] or times))
    if spec.get("compare"):
        mx.save_safetensors(spec["compare"], {"dq": g[0], "dk": g[1], "dv": g[2]})
    return out


def _rel(a, b):
    import mlx.core as mx
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--contexts", default="8192,122880,131072,262144,524288")
    ap.add_argument("--modes", default="whole,blocked8192")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="output dir (default: reports/<name>/<version>/<tag>)")
    ap.add_argument("--tag", default="h200-1b")
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(run_case(json.loads(a.worker))), flush=True)
        return 0
    out_dir = Path(a.out) if a.out else report_dir("attention_limit", a.tag)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for T in [int(x) for x in a.contexts.split(",")]:
        saved = {}
        for mode in a.modes.split(","):
            path = f"/tmp/attn_{T}_{mode}.safetensors"
            spec = dict(context=T, mode=mode, head_dim=a.head_dim, heads=a.heads,
                        kv_heads=a.kv_heads, dtype=a.dtype, steps=a.steps,
                        compare=path if T <= 131072 else None)
            try:
                r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                   capture_output=True, text=True, timeout=a.timeout)
                lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
                row = json.loads(lines[-1]) if lines else dict(
                    context=T, mode=mode, status="crashed",
                    error=" / ".join((r.stderr or "").strip().splitlines()[-3:])[:300])
            except subprocess.TimeoutExpired:
                row = dict(context=T, mode=mode, status="timeout", error=f"> {a.timeout}s")
            if row.get("status") == "ok" and spec["compare"]:
                saved[mode] = path
            rows.append(row)
            print(json.dumps(row), flush=True)
        if "whole" in saved and len(saved) > 1:
            import mlx.core as mx
            ref = mx.load(saved["whole"])
            for mode, p in saved.items():
                if mode == "whole":
                    continue
                got = mx.load(p)
                row = next(r for r in rows if r["context"] == T and r["mode"] == mode)
                for n in ("dq", "dk", "dv"):
                    row[f"rel_{n}"] = f"{_rel(got[n], ref[n]):.2e}"
                print(T, mode, {n: row[f"rel_{n}"] for n in ("dq", "dk", "dv")}, flush=True)
    write_csv(out_dir / "attention_limit.csv", rows, FIELDS)
    cmd = "python experiments/attention_limit.py " + " ".join(sys.argv[1:])
    md = [f"# Fused vs query-blocked attention backward ({a.tag})", "",
          f"`{cmd}`", "", f"Machine: {machine()}. Shape: B=1, {a.heads} heads / {a.kv_heads} KV "
          f"heads, head_dim {a.head_dim}, {a.dtype}, causal.", "",
          md_table(FIELDS, [[r.get(f, "") if not isinstance(r.get(f), float) else f"{r[f]:.3f}"
                             for f in FIELDS] for r in rows]), ""]
    (out_dir / "attention_limit.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
