"""Does a training step leak? Active memory per step over >= 200 steps, three backward styles.

    python experiments/leak.py                       # CPU-sized model, 200 steps per mode
    python experiments/leak.py --preset 1b --context 2048 --steps 200   # GPU

  (a) surrogate   per segment, `mx.value_and_grad` of the surrogate loss
                  sum(stop_gradient(dh_out) * segment(h_in)) w.r.t. [h_in, LoRA params]
                  (optiq's trick; mlx-bun measured ~32 MB/segment/step live growth with it)
  (b) vjp         per segment `mx.vjp` (train.segmented.segmented_value_and_grad)
  (c) full        `nn.value_and_grad` over the whole model

Each mode runs in its own subprocess: build the model, LoRA r=8 on every block,
Adam; per step: gradients, update, `mx.eval`, drop the step's temporaries,
`gc.collect()`, then record `mx.get_active_memory()` (live bytes, the cache
excluded) and `mx.get_cache_memory()`. The slope is a least-squares fit of active
bytes over the steps after a warm-up; verdict "leaks" when the growth over the
fitted steps exceeds both 64 KiB and 0.5% of the resting active memory.
Writes reports/leak/<version>/<tag>/{leak.csv, leak.md, leak.png}.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import (build_pair, dump_json, machine, md_table, preset_config,  # noqa: E402
                                 report_dir, version, write_csv)

MODES = ["surrogate", "vjp", "full"]
# negative control (not run by default): the full backward, but every step's gradients are
# kept alive in a list, so active memory must grow; the verdict has to say "leaks"
CONTROL = "control_leak"
WARMUP = 10


def surrogate_value_and_grad(model, batch, lengths, segment_size):
    """Segmented backward built on value_and_grad of a surrogate loss (no KV sharing)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

    from train.loss import head_loss, split_batch
    from train.segmented import plan_segments

    inputs, targets, mask = split_batch(batch, lengths)
    n = len(model.layers)
    segs = plan_segments(n, segment_size)
    h, ctx = model.begin(inputs)
    h = mx.stop_gradient(h)
    mx.eval(h)
    bounds = [h]
    for lo, hi in segs:
        for i in range(lo, hi):
            h = model.layer_step(i, h, ctx)
        h = mx.stop_gradient(h)
        mx.eval(h)
        bounds.append(h)

    def head(hl):
        return head_loss(model, hl, targets, mask, "full")[0]

    loss, dh = mx.value_and_grad(head)(bounds[-1])
    mx.eval(loss, dh)
    flat = {}
    paths = {id(m): p for p, m in model.named_modules()}
    for s in reversed(range(len(segs))):
        lo, hi = segs[s]
        per = [tree_flatten(model.layers[i].trainable_parameters()) for i in range(lo, hi)]
        names = [[k for k, _ in p] for p in per]
        arrays = [v for p in per for _, v in p]

        def surrogate(h_in, *ps, lo=lo, hi=hi, names=names, cot=dh):
            pos = 0
            for i, nm in zip(range(lo, hi), names):
                model.layers[i].update(tree_unflatten(list(zip(nm, ps[pos:pos + len(nm)]))))
                pos += len(nm)
            x = h_in
            for i in range(lo, hi):
                x = model.layer_step(i, x, ctx)
            return (mx.stop_gradient(cot) * x).astype(mx.float32).sum()

        argn = list(range(1 + len(arrays)))
        _, g = mx.value_and_grad(surrogate, argnums=argn)(bounds[s], *arrays)
        dh = g[0]
        k = 1
        for i, nm in zip(range(lo, hi), names):
            for name in nm:
                flat[f"{paths[id(model.layers[i])]}.{name}"] = g[k]
                k += 1
            model.layers[i].update(tree_unflatten(per[i - lo]))
        mx.eval(dh, *g[1:])
        del bounds[s + 1]
    grads = tree_map_with_path(lambda p, x: flat[p], model.trainable_parameters())
    return (loss, mask.sum()), grads


def run_mode(spec: dict) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from engine.adapters.lora import apply_lora
    from train.loss import sft_loss
    from train.segmented import segmented_value_and_grad

    cfg = preset_config(spec["preset"])
    model = build_pair(cfg, spec["dtype"], "ours", seed=0)
    model.freeze()
    mx.random.seed(0)
    apply_lora(model, rank=8, scale=20.0, dropout=0.0, num_layers=-1)
    model.train()
    T, S, mode = spec["context"], spec["segment_size"], spec["mode"]
    rng = np.random.default_rng(0)
    batch = mx.array(rng.integers(4, min(cfg["vocab_size"], 1000), size=(1, T + 1)).astype(np.int32))
    lengths = mx.array([[0, T + 1]])
    opt = optim.Adam(learning_rate=1e-5)
    kept = []  # CONTROL only
    if mode in ("full", CONTROL):
        vg = nn.value_and_grad(model, sft_loss)
    elif mode == "vjp":
        vg = lambda m, b, l: segmented_value_and_grad(m, b, l, S, head="full")  # noqa: E731
    else:
        vg = lambda m, b, l: surrogate_value_and_grad(m, b, l, S)  # noqa: E731
    active, cache, losses, times = [], [], [], []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        (loss, _), grads = vg(model, batch, lengths)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        losses.append(float(loss.item()))
        if mode == CONTROL:
            kept.append(grads)
        del grads, loss
        gc.collect()
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        active.append(mx.get_active_memory())
        cache.append(mx.get_cache_memory())
    return {"mode": mode, "active": active, "cache": cache, "loss": losses, "time": times,
            "peak": mx.get_peak_memory()}


def slope(ys):
    import numpy as np
    x = np.arange(len(ys), dtype=np.float64)
    a, _ = np.polyfit(x, np.asarray(ys, dtype=np.float64), 1)
    return float(a)


def verdict(active):
    fit = active[WARMUP:]
    s = slope(fit)
    growth = s * (len(fit) - 1)
    rest = float(min(fit))
    leaks = growth > max(64 * 1024, 0.005 * rest)
    return s, growth, rest, ("leaks" if leaks else "flat")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--segment-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None, help="output dir (default reports/leak/<version>/<tag>)")
    ap.add_argument("--timeout", type=int, default=1800)
    a = ap.parse_args(argv)
    bad = [m for m in a.modes.split(",") if m not in MODES + [CONTROL]]
    if bad:
        ap.error(f"unknown modes {bad}; have {MODES + [CONTROL]}")
    if a.worker:
        print(json.dumps(run_mode(json.loads(a.worker))), flush=True)
        return 0
    import mlx.core as mx
    gpu = mx.default_device() == mx.gpu
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    T = a.context or (128 if a.preset == "cpu" else 2048)
    tag = a.tag or f"{'gpu' if gpu else 'cpu'}-{a.preset}-{dtype}-T{T}-S{a.segment_size}"
    out = Path(a.out) if a.out else report_dir("leak", tag)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in a.modes.split(","):
        spec = dict(mode=mode, preset=a.preset, dtype=dtype, context=T,
                    segment_size=a.segment_size, steps=a.steps)
        t0 = time.time()
        r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                           capture_output=True, text=True, timeout=a.timeout)
        lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
        if r.returncode != 0 or not lines:
            print(f"{mode}: failed: {r.stderr.strip().splitlines()[-3:]}", flush=True)
            continue
        res = json.loads(lines[-1])
        res["slope"], res["growth"], res["rest"], res["verdict"] = verdict(res["active"])
        results.append(res)
        print(f"{mode:>10}: {res['verdict']}, slope {res['slope']:.1f} B/step, growth "
              f"{res['growth'] / 1e6:.3f} MB over {len(res['active']) - WARMUP} steps, resting "
              f"{res['rest'] / 1e6:.2f} MB ({time.time() - t0:.0f}s)", flush=True)
    rows = [{"mode": r["mode"], "step": i, "active_bytes": a_, "cache_bytes": c, "loss": l,
             "step_time_s": t}
            for r in results for i, (a_, c, l, t) in enumerate(zip(r["active"], r["cache"],
                                                                   r["loss"], r["time"]))]
    write_csv(out / "leak.csv", rows, ["mode", "step", "active_bytes", "cache_bytes", "loss",
                                       "step_time_s"])
    table = [[r["mode"], len(r["active"]), f"{r['rest'] / 1e6:.3f}", f"{r['slope']:.1f}",
              f"{r['growth'] / 1e6:.3f}", f"{sorted(r['time'])[len(r['time']) // 2]:.3f}",
              f"{r['loss'][-1]:.5f}", f"**{r['verdict']}**"] for r in results]
    md = [f"# Leak check ({tag})", "",
          f"engine {version()}, preset `{a.preset}` ({dtype}), context {T}, segment size "
          f"{a.segment_size}, LoRA r=8 on every block, Adam. Machine: {machine()}.", "",
          f"Active memory (`mx.get_active_memory()` after each step, cache excluded); slope = "
          f"least squares over steps {WARMUP}..end; leaks = growth > max(64 KiB, 0.5% of resting).",
          "", md_table(["mode", "steps", "resting MB", "slope B/step", "growth MB",
                        "median step s", "final loss", "verdict"], table), ""]
    (out / "leak.md").write_text("\n".join(md))
    dump_json(out / "meta.json", {"machine": machine(), "preset": a.preset, "context": T,
                                  "segment_size": a.segment_size, "steps": a.steps})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot([x / 1e6 for x in r["active"]], label=f"{r['mode']} ({r['verdict']}, "
                                                      f"{r['slope']:.0f} B/step)")
    ax.set_xlabel("step")
    ax.set_ylabel("active memory (MB)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Active memory per training step ({tag})")
    fig.tight_layout()
    fig.savefig(out / "leak.png", dpi=120)
    print("\n".join(md))
    print(json.dumps({"report": str(out), "verdicts": {r["mode"]: r["verdict"] for r in results}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
