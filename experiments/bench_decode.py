"""Decode benchmark: our token loop vs mlx-lm's `generate_step`, same process, same model.

For each model and prompt length: prefill tok/s (prompt / time to the first
token), decode tok/s (over `--gen` tokens after the first), and peak memory
(`mx.get_peak_memory`, reset per run). Engines alternate within each trial and
the best of `--trials` is kept, so background noise hits both alike. Ratios are
ours / mlx-lm (>1 = we are faster; for memory <1 = we use less).

    python experiments/bench_decode.py --quick                     # CPU fixtures
    python experiments/bench_decode.py --model DIR --tag h200-1b   # e.g. a 1B preset on the H200

Writes CSV + markdown + PNG to reports/bench_decode/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from engine.loader import load_model as load_ours  # noqa: E402
from engine.stepper import generate_step as ours_step  # noqa: E402


def _time_run(step_fn, model, prompt, gen):
    mx.synchronize()
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    it = step_fn(mx.array(prompt), model, max_tokens=gen + 1)
    first = next(it)
    t1 = time.perf_counter()
    n = 0
    for _ in it:
        n += 1
    mx.synchronize()
    t2 = time.perf_counter()
    del first
    return {"prefill_tps": len(prompt) / (t1 - t0), "decode_tps": n / (t2 - t1) if n else 0.0,
            "peak_gb": mx.get_peak_memory() / 1e9}


def bench(model_dir, lengths, gen, trials, vocab=None):
    from mlx_lm.generate import generate_step as ref_step
    from mlx_lm.utils import load_model as load_ref

    ours = load_ours(model_dir)[0]
    ref = load_ref(Path(model_dir))[0]
    vocab = vocab or ours.args.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for L in lengths:
        prompt = rng.integers(32, min(vocab, 1000) - 1, size=L).tolist()
        _time_run(ours_step, ours, prompt[:64], 4)   # warm-up (kernel compilation)
        _time_run(ref_step, ref, prompt[:64], 4)
        best = {"ours": None, "mlx_lm": None}
        for t in range(trials):
            order = [("ours", ours_step, ours), ("mlx_lm", ref_step, ref)]
            if t % 2:
                order.reverse()
            for name, fn, m in order:
                r = _time_run(fn, m, prompt, gen)
                b = best[name]
                best[name] = r if b is None else {
                    "prefill_tps": max(b["prefill_tps"], r["prefill_tps"]),
                    "decode_tps": max(b["decode_tps"], r["decode_tps"]),
                    "peak_gb": min(b["peak_gb"], r["peak_gb"])}
        o, m = best["ours"], best["mlx_lm"]
        row = {"model": Path(model_dir).name, "prompt": L, "gen": gen,
               "ours_prefill_tps": o["prefill_tps"], "mlxlm_prefill_tps": m["prefill_tps"],
               "prefill_ratio": o["prefill_tps"] / m["prefill_tps"],
               "ours_decode_tps": o["decode_tps"], "mlxlm_decode_tps": m["decode_tps"],
               "decode_ratio": o["decode_tps"] / m["decode_tps"] if m["decode_tps"] else float("nan"),
               "ours_peak_gb": o["peak_gb"], "mlxlm_peak_gb": m["peak_gb"],
               "peak_ratio": o["peak_gb"] / m["peak_gb"] if m["peak_gb"] else float("nan")}
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
        rows.append(row)
    return rows


def write(rows, out: Path, note: str):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_decode.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [f"# Decode benchmark — mlx-parity {engine.__version__}", "", note, "",
             "| model | prompt | prefill tok/s ours / mlx-lm (ratio) | decode tok/s ours / mlx-lm (ratio) | peak GB ours / mlx-lm |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['prompt']} | {r['ours_prefill_tps']:.1f} / {r['mlxlm_prefill_tps']:.1f} "
                     f"({r['prefill_ratio']:.3f}) | {r['ours_decode_tps']:.1f} / {r['mlxlm_decode_tps']:.1f} "
                     f"({r['decode_ratio']:.3f}) | {r['ours_peak_gb']:.4f} / {r['mlxlm_peak_gb']:.4f} |")
    (out / "bench_decode.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key in zip(axes, ("prefill_ratio", "decode_ratio")):
            for model in sorted({r["model"] for r in rows}):
                rs = [r for r in rows if r["model"] == model]
                ax.plot([r["prompt"] for r in rs], [r[key] for r in rs], marker="o", label=model)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(f"{key} (ours / mlx-lm)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "bench_decode.png", dpi=110)
    except ImportError:  # pragma: no cover
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model dir (repeatable)")
    ap.add_argument("--quick", action="store_true", help="CPU fixtures")
    ap.add_argument("--lengths", default="128,2048,8192")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    models = a.model or []
    if a.quick or not models:
        from parity.fixtures.models import ensure_fixture
        models += [str(ensure_fixture(f, "bfloat16")) for f in ("llama", "qwen3", "gemma4_text")]
    rows = []
    for m in models:
        rows += bench(m, lengths, a.gen, a.trials)
    tag = a.tag or ("cpu-fixtures" if a.quick or not a.model else "custom")
    out = Path(a.out) if a.out else REPO / "reports" / "bench_decode" / engine.__version__ / tag
    cmd = "python experiments/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write(rows, out, f"Device {mx.default_device()}, mlx {mx.__version__}. Best of {a.trials} trials, "
                     f"{a.gen} decode tokens. Reproduce: `{cmd.strip()}`")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
