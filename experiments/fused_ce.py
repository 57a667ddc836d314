"""MLX's fused `mx.fast.cross_entropy` vs the loss heads we train with.

    python experiments/fused_ce.py --rows 32768 --hidden 2048 --vocab 32000   # H200 (1B head)
    python experiments/fused_ce.py --rows 2048 --hidden 256 --vocab 4096 --dtype float32  # CPU

One loss head: h [rows, hidden] -> logits = h @ W.T [rows, vocab] -> mean CE over
the rows, value and gradient w.r.t. h (and W's LoRA-free weight is frozen, as in
LoRA training). Variants:

  mlx_lm      nn.losses.cross_entropy over the full logits (mlx-lm's default_loss)
  fast_full   mx.fast.cross_entropy over the full logits
  chunked     our chunked head: `--chunk` rows at a time under mx.checkpoint, nn CE
  fast_chunk  the same with mx.fast.cross_entropy

Per variant, in a fresh subprocess: peak memory above the inputs, median time of
value_and_grad over `--steps` runs after a warm-up, and whether the loss and dh
are bit-identical to mlx_lm's (plus the largest relative difference).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import machine, md_table, report_dir, write_csv  # noqa: E402

VARIANTS = ["mlx_lm", "fast_full", "chunked", "fast_chunk"]
FIELDS = ["variant", "status", "peak_over_inputs_gb", "time_s", "loss", "loss_exact", "dh_exact",
          "dh_max_rel", "error"]


def _ce(kind):
    import mlx.core as mx
    import mlx.nn as nn
    return mx.fast.cross_entropy if kind == "fast" else nn.losses.cross_entropy


def loss_fn(variant, W, t, chunk):
    import mlx.core as mx
    ce = _ce("fast" if variant.startswith("fast") else "nn")
    if variant in ("mlx_lm", "fast_full"):
        return lambda h: ce(h @ W.T, t).astype(mx.float32).sum() / t.shape[0]

    def f(h):
        parts = [mx.checkpoint(lambda hr, tr=t[s:s + chunk]: ce(hr @ W.T, tr))(h[s:s + chunk])
                 for s in range(0, h.shape[0], chunk)]
        return mx.concatenate(parts).astype(mx.float32).sum() / t.shape[0]
    return f


def run_variant(spec):
    import mlx.core as mx
    dtype = getattr(mx, spec["dtype"])
    k = mx.random.split(mx.random.key(0), 3)
    h = mx.random.normal((spec["rows"], spec["hidden"]), key=k[0]).astype(dtype)
    W = (mx.random.normal((spec["vocab"], spec["hidden"]), key=k[1]) * 0.02).astype(dtype)
    t = mx.random.randint(0, spec["vocab"], (spec["rows"],), key=k[2])
    mx.eval(h, W, t)
    vg = mx.value_and_grad(loss_fn(spec["variant"], W, t, spec["chunk"]))
    times = []
    for _ in range(spec["steps"] + 1):
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        loss, dh = vg(h)
        mx.eval(loss, dh)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        peak = mx.get_peak_memory() - base
    mx.save_safetensors(spec["out"], {"loss": loss, "dh": dh})
    return {"variant": spec["variant"], "status": "ok", "peak_over_inputs_gb": peak / 1e9,
            "time_s": statistics.median(times[1:]), "loss": loss.item()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="output dir (default: reports/<name>/<version>/<tag>)")
    ap.add_argument("--tag", default=None)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(run_variant(json.loads(a.worker))), flush=True)
        return 0
    import mlx.core as mx
    tag = a.tag or f"{'gpu' if mx.default_device() == mx.gpu else 'cpu'}-{a.dtype}"
    out = Path(a.out) if a.out else report_dir("fused_ce", tag)
    out.mkdir(parents=True, exist_ok=True)
    rows, res = [], {}
    tmp = tempfile.mkdtemp()
    for v in VARIANTS:
        spec = {k: w for k, w in vars(a).items() if k not in ("worker", "tag", "out")}
        spec.update(variant=v, out=str(Path(tmp) / f"{v}.safetensors"))
        r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                           capture_output=True, text=True)
        lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
        row = json.loads(lines[-1]) if lines else {
            "variant": v, "status": "failed",
            "error": " / ".join(r.stderr.strip().splitlines()[-2:])[:300]}
        if row["status"] == "ok":
            res[v] = mx.load(spec["out"])
        rows.append(row)
    ref = res.get("mlx_lm")
    for row in rows:
        got = res.get(row["variant"])
        if ref is None or got is None:
            continue
        row["loss_exact"] = bool(mx.array_equal(got["loss"], ref["loss"]).item())
        row["dh_exact"] = bool(mx.array_equal(got["dh"], ref["dh"]).item())
        d = mx.abs(got["dh"].astype(mx.float32) - ref["dh"].astype(mx.float32)).max()
        row["dh_max_rel"] = f"{(d / mx.abs(ref['dh'].astype(mx.float32)).max()).item():.2e}"
    write_csv(out / "fused_ce.csv", rows, FIELDS)
    cmd = "python experiments/fused_ce.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"# mx.fast.cross_entropy vs our loss heads ({tag})", "", f"`{cmd}`", "",
          f"Machine: {machine()}. Head: rows {a.rows}, hidden {a.hidden}, vocab {a.vocab}, "
          f"{a.dtype}, chunk {a.chunk}; value_and_grad w.r.t. h, median of {a.steps}.", "",
          md_table(FIELDS, [[(f"{r[f]:.4f}" if isinstance(r.get(f), float) else r.get(f, ""))
                             for f in FIELDS] for r in rows]), ""]
    (out / "fused_ce.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
