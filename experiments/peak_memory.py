"""Peak memory and step time of one LoRA training step: context length x backward mode.

    python experiments/peak_memory.py --quick                      # CPU, a few minutes
    python experiments/peak_memory.py --preset 1b --contexts 2048,8192,16384,32768   # H200

Modes (LoRA rank 8 on every projection of every block, batch 1, every token a
target, Adam step included):

  mlx_lm_full        mlx-lm: nn.value_and_grad(default_loss) over its model
  mlx_lm_ckpt        mlx-lm with its --grad-checkpoint (tuner.trainer.grad_checkpoint)
  ours_full          our full backward, full-logits loss head
  ours_ckpt          our per-block mx.checkpoint, chunked loss head
  ours_seg{1,2,4}    our segmented backward, S blocks per segment, chunked loss head
  ours_seg1_fullhead segmented S=1 with the full-logits head (isolates the head's share)
  ours_seg1_mlpchunk segmented S=1, each block's MLP half in --mlp-chunk token chunks
  ours_seg1_tokchunk segmented S=1, every per-token part of each block (norms, q/k/v/o
                     projections, RoPE, MLP) in --token-chunk token chunks; only SDPA
                     sees the whole sequence

Every (mode, context) cell runs in its own subprocess (fresh allocator, peak
counter and - for mlx-lm's checkpointing, which patches the block class
process-wide - a fresh mlx-lm). Per cell: build the random-weight model,
evaluate it, one warm-up step, then `--steps` timed steps; before each,
`mx.reset_peak_memory()`; reported: the largest `mx.get_peak_memory()` (peak
live bytes, weights included), the resting bytes before the step, the median
step time (after `mx.synchronize()`), and the loss.

Results merge into reports/peak_memory/<version>/<tag>/ (CSV + markdown + PNG):
a later run with other --modes/--contexts adds or replaces its cells, so the
sweep can be split over several runs (the device allows 10 minutes a command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import (build_pair, dump_json, machine, md_table, preset_config,  # noqa: E402
                                 read_csv, report_dir, version, write_csv)

MODES = ["mlx_lm_full", "mlx_lm_ckpt", "ours_full", "ours_ckpt", "ours_seg1", "ours_seg2",
         "ours_seg4", "ours_seg1_fullhead", "ours_seg1_mlpchunk", "ours_seg1_tokchunk"]
FIELDS = ["mode", "context", "status", "peak_bytes", "resting_bytes", "step_time_s", "loss",
          "steps", "preset", "dtype", "device", "attn_block", "error"]
TARGET_PEAK, TARGET_TIME = 0.4, 1.5


# --- one cell (runs in a subprocess) ------------------------------------------------

def _step_fn(mode, model, chunk, mlp_chunk, token_chunk=4096, attn_block=0):
    import mlx.nn as nn
    import mlx.optimizers as optim

    from train.trainer import TrainConfig, loss_and_grad_fn

    opt = optim.Adam(learning_rate=1e-5)
    if mode.startswith("mlx_lm"):
        from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
        if mode == "mlx_lm_ckpt":
            grad_checkpoint(model.layers[0])
        vg = nn.value_and_grad(model, default_loss)
    else:
        cfg = {"ours_full": TrainConfig(loss_head="full"),
               "ours_ckpt": TrainConfig(grad_checkpoint=True, loss_head="chunked"),
               "ours_seg1_fullhead": TrainConfig(segment_size=1, loss_head="full"),
               "ours_seg1_mlpchunk": TrainConfig(segment_size=1, loss_head="chunked",
                                                 mlp_chunk=mlp_chunk),
               "ours_seg1_tokchunk": TrainConfig(segment_size=1, loss_head="chunked",
                                                 token_chunk=token_chunk,
                                                 attn_block=attn_block)}.get(mode)
        if cfg is None:
            cfg = TrainConfig(segment_size=int(mode[len("ours_seg"):]), loss_head="chunked")
        cfg.chunk_size = chunk
        vg = loss_and_grad_fn(model, cfg)

    def step(batch, lengths):
        (loss, _), grads = vg(model, batch, lengths)
        opt.update(model, grads)
        return loss

    return step, opt


def run_cell(spec: dict) -> dict:
    import mlx.core as mx
    import numpy as np

    mode, T = spec["mode"], int(spec["context"])
    cfg = preset_config(spec["preset"])
    side = "mlx_lm" if mode.startswith("mlx_lm") else "ours"
    model = build_pair(cfg, spec["dtype"], side, seed=0)
    model.freeze()
    mx.random.seed(0)
    if side == "mlx_lm":
        from mlx_lm.tuner.utils import linear_to_lora_layers
        linear_to_lora_layers(model, -1, {"rank": 8, "scale": 20.0, "dropout": 0.0})
    else:
        from engine.adapters.lora import apply_lora
        apply_lora(model, rank=8, scale=20.0, dropout=0.0, num_layers=-1)
    model.train()
    mx.eval(model.parameters())
    rng = np.random.default_rng(T)
    batch = mx.array(rng.integers(4, min(cfg["vocab_size"], 1000), size=(1, T + 1)).astype(np.int32))
    lengths = mx.array([[0, T + 1]])
    step, opt = _step_fn(mode, model, spec["chunk"], spec.get("mlp_chunk", 4096),
                         spec.get("token_chunk", 4096), spec.get("attn_block", 0))
    out = {"mode": mode, "context": T, "preset": spec["preset"], "dtype": spec["dtype"],
           "device": str(mx.default_device())}
    if mode == "ours_seg1_tokchunk":  # query rows per attention block this cell ran (0: whole)
        from train.segmented import resolve_attn_block
        out["attn_block"] = resolve_attn_block(spec.get("attn_block", 0), T)
    if spec.get("warmup", 1):
        loss = step(batch, lengths)  # warm-up (kernel compilation), also initialises Adam
        mx.eval(loss, model.parameters(), opt.state)
    else:  # huge contexts: no warm-up step; the timed step includes compilation
        opt.init(model.trainable_parameters())
        mx.eval(opt.state)
    peaks, times, rest = [], [], []
    for _ in range(spec["steps"]):
        mx.synchronize()
        mx.clear_cache()
        rest.append(mx.get_active_memory())
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        loss = step(batch, lengths)
        mx.eval(loss, model.parameters(), opt.state)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(mx.get_peak_memory())
    out.update(status="ok", peak_bytes=max(peaks), resting_bytes=max(rest),
               step_time_s=statistics.median(times), loss=float(loss.item()), steps=spec["steps"])
    return out


# --- driver -----------------------------------------------------------------------

def run_all(modes, contexts, preset, dtype, steps, chunk, timeout, mlp_chunk=4096,
            token_chunk=4096, attn_block=0, warmup=1):
    rows = []
    for T in contexts:
        for mode in modes:
            spec = dict(mode=mode, context=T, preset=preset, dtype=dtype, steps=steps, chunk=chunk,
                        mlp_chunk=mlp_chunk, token_chunk=token_chunk, attn_block=attn_block,
                        warmup=warmup)
            t0 = time.time()
            try:
                r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                   capture_output=True, text=True, timeout=timeout)
                lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
                if r.returncode == 0 and lines:
                    row = json.loads(lines[-1])
                else:
                    tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
                    row = dict(spec, status="failed", error=" / ".join(tail)[:300])
            except subprocess.TimeoutExpired:
                row = dict(spec, status="timeout", error=f"> {timeout}s")
            rows.append(row)
            pk = row.get("peak_bytes")
            print(f"{mode:>20} T={T:>6}: {row['status']}"
                  + (f" peak {float(pk) / 1e9:.3f} GB, step {float(row['step_time_s']):.3f} s, "
                     f"loss {float(row['loss']):.5f}" if pk else f" {row.get('error', '')}")
                  + f"  ({time.time() - t0:.0f}s)", flush=True)
    return rows


def _f(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def summarise(rows, tag, meta):
    contexts = sorted({int(r["context"]) for r in rows})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    cell = {(r["mode"], int(r["context"])): r for r in rows}
    hdr = ["mode"] + [f"{T}" for T in contexts]

    def fmt(key, scale, digits):
        out = []
        for m in modes:
            line = [m]
            for T in contexts:
                r = cell.get((m, T))
                v = _f(r.get(key)) if r else None
                line.append(f"{v / scale:.{digits}f}" if v is not None else
                            (r["status"] if r else "-"))
            out.append(line)
        return out

    peaks = [_f(r.get("peak_bytes")) for r in rows if _f(r.get("peak_bytes"))]
    unit, scale = ("GB", 1e9) if peaks and max(peaks) >= 1e9 else ("MB", 1e6)
    parts = [f"# Peak memory of a LoRA training step ({tag})", "",
             f"engine {version()}, preset `{meta['preset']}` ({meta['dtype']}), batch 1, LoRA r=8 "
             f"on every projection of every block, every token a target, Adam step included. "
             f"Machine: {meta['machine']}.", "",
             "Commands (cells merged from each):", "",
             *[f"    {c}" for c in meta.get("commands", [])], "",
             "Peak = `mx.get_peak_memory()` during one step (reset before it; weights included), "
             f"{unit}:", "", md_table(hdr, fmt("peak_bytes", scale, 3 if unit == "GB" else 1)), "",
             f"Resting (active before the step: weights, LoRA, Adam state), {unit}:", "",
             md_table(hdr, fmt("resting_bytes", scale, 3 if unit == "GB" else 1)), "",
             "Step time, s (median):", "", md_table(hdr, fmt("step_time_s", 1, 3)), "",
             "Loss (same weights and tokens in every mode):", "",
             md_table(hdr, fmt("loss", 1, 5)), ""]
    ref = "mlx_lm_ckpt"
    ratios = []
    for T in contexts:
        b = cell.get((ref, T))
        if not b or _f(b.get("peak_bytes")) is None:
            continue
        for m in modes:
            r = cell.get((m, T))
            if m.startswith("ours") and r and _f(r.get("peak_bytes")):
                ratios.append([m, T, f"{_f(r['peak_bytes']) / _f(b['peak_bytes']):.3f}",
                               f"{_f(r['step_time_s']) / _f(b['step_time_s']):.2f}"])
    if ratios:
        parts += ["Ours vs mlx-lm's `--grad-checkpoint` (peak ratio, step-time ratio):", "",
                  md_table(["mode", "context", "peak / mlx-lm ckpt", "time / mlx-lm ckpt"], ratios),
                  ""]
        Tmax = max(int(r[1]) for r in ratios)
        best = [r for r in ratios if int(r[1]) == Tmax and float(r[2]) <= TARGET_PEAK
                and float(r[3]) <= TARGET_TIME]
        parts.append(f"Target at the largest context ({Tmax}): peak <= {TARGET_PEAK}x and step time "
                     f"<= {TARGET_TIME}x mlx-lm's grad-checkpoint: "
                     + ("met by " + ", ".join(r[0] for r in best) if best else "**not met**") + ".")
    return "\n".join(parts) + "\n"


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in MODES:
        pts = sorted((int(r["context"]), _f(r.get("peak_bytes")), _f(r.get("step_time_s")))
                     for r in rows if r["mode"] == m and _f(r.get("peak_bytes")))
        if not pts:
            continue
        style = "--" if m.startswith("mlx_lm") else "-"
        axes[0].plot([p[0] for p in pts], [p[1] / 1e9 for p in pts], style, marker="o", label=m)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o", label=m)
    for ax, yl in zip(axes, ("peak memory (GB)", "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="CPU-sized model and contexts")
    ap.add_argument("--preset", default=None,
                    help="cpu | 1b | 8b | e4b | speed (default: cpu with --quick, else 1b)")
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell")
    ap.add_argument("--chunk-size", type=int, default=1024, help="rows per loss-head chunk")
    ap.add_argument("--mlp-chunk", type=int, default=None,
                    help="tokens per MLP chunk for ours_seg1_mlpchunk (default: context/8, min 64)")
    ap.add_argument("--token-chunk", type=int, default=None,
                    help="tokens per chunk for ours_seg1_tokchunk (default: 4096 on GPU, "
                         "context/4 on CPU)")
    ap.add_argument("--attn-block", type=int, default=0,
                    help="ours_seg1_tokchunk: query rows per attention block (0: automatic - "
                         "8192-row blocks beyond 65536 tokens; -1: never)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="warm-up steps per cell (0 for huge contexts: the timed step then "
                         "includes kernel compilation)")
    ap.add_argument("--tag", default=None, help="report subdirectory (default: derived)")
    ap.add_argument("--out", default=None,
                    help="output dir (default reports/peak_memory/<version>/<tag>)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(run_cell(json.loads(a.worker))), flush=True)
        return 0
    import mlx.core as mx
    gpu = mx.default_device() == mx.gpu
    preset = a.preset or ("cpu" if a.quick else "1b")
    contexts = [int(x) for x in (a.contexts or ("256,512,1024" if a.quick else
                                                "2048,8192,16384,32768")).split(",")]
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    steps = a.steps or (3 if gpu else 1)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; have {MODES}")
    tag = a.tag or f"{'gpu' if gpu else 'cpu'}-{preset}-{dtype}"
    out = Path(a.out) if a.out else report_dir("peak_memory", tag)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"preset": preset, "dtype": dtype, "machine": machine(), "config": preset_config(preset),
            "chunk_size": a.chunk_size, "steps": steps,
            "token_chunk": a.token_chunk or ("4096" if gpu else "context/4"),
            "mlp_chunk": a.mlp_chunk or "context/8", "attn_block": a.attn_block,
            "warmup": a.warmup}
    print(f"peak_memory: preset {preset} {dtype}, contexts {contexts}, modes {modes} -> {out}",
          flush=True)
    rows = []
    for T in contexts:
        mc = a.mlp_chunk or max(64, T // 8)
        tc = a.token_chunk or (4096 if gpu else max(64, T // 4))
        rows += run_all(modes, [T], preset, dtype, steps, a.chunk_size, a.timeout, mc, tc,
                        a.attn_block, a.warmup)
    # merge with earlier cells of the same tag (this version's directory only)
    old = [r for r in read_csv(out / "peak_memory.csv")
           if (r["mode"], int(r["context"])) not in {(x["mode"], int(x["context"])) for x in rows}]
    allrows = sorted(old + rows, key=lambda r: (int(r["context"]), MODES.index(r["mode"])))
    write_csv(out / "peak_memory.csv", allrows, FIELDS)
    cmd = "python experiments/peak_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    old_meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    meta["commands"] = [c for c in old_meta.get("commands", []) if c != cmd] + [cmd]
    (out / "peak_memory.md").write_text(summarise(allrows, tag, meta))
    dump_json(out / "meta.json", meta)
    plot(allrows, out / "peak_memory.png", f"LoRA step peak memory, {preset} {dtype} ({tag})")
    print((out / "peak_memory.md").read_text())
    print(json.dumps({"report": str(out), "cells": len(rows),
                      "failed": sum(r["status"] != "ok" for r in rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
