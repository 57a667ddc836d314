"""Where an L3 decode step's time goes around the one kernel, on a GPU (ms per token).

From one prefilled prompt, each mode decodes --gen tokens greedily (the caches set back to the
prompt before every trial; medians of --trials trials):

- `kernel`: the one kernel's own timer (MLXP_MEGA_PROF=1, the phases' sum, read back every
  step; a separate decoder, so the timed modes below run without the timer);
- `fixed`: the decoder queued step after step on the same token (no argmax; the steps still
  follow one another through the position and the caches), one wait at the end;
- `chain`: y = argmax(decoder(y)) queued step after step (`mx.async_eval`), one wait at the end:
  the GPU's time per step with nothing on the host in between;
- `chain_lse`: the same with the log-probabilities the stepper computes (logits − logsumexp);
- `stepper`: `engine.step.stepper.generate_step`, what `bench_decode.py` times (a token handed to
  the host every step, the next step queued before).

`fixed` − `kernel` is what the step costs besides the kernel's phases (its launch, the
workspace fills, the position, the gaps between them; the timer itself adds a little to
`kernel`); `chain` − `fixed` the argmax (and its token turned into int32); `chain_lse` −
`chain` the log-probabilities;
`stepper` − `chain_lse` the host. With --ops, the operations of one step's
graph by name (`mx.export_to_dot`).

    python experiments/step_overhead.py --model DIR [--prompt 128] [--gen 64] [--trials 5]
        [--ops] [--out FILE.json]
    python experiments/step_overhead.py --from-json FILE.json [FILE2.json ...] --report DIR
        # overhead.md (pandas) and overhead.png (matplotlib): where each model's step goes
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast.decode import FastDecoder, FastStep  # noqa: E402
from engine.levers import resolve, with_levers  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.step.stepper import generate_step  # noqa: E402
from experiments._common import md_table, mega_env  # noqa: E402

MODES = ("fixed", "chain", "chain_lse", "stepper")


def _reset(caches, n: int) -> None:
    for c in caches:
        c.offset = n


def timed(mode: str, model, dec, caches, prompt, gen: int) -> float:
    """ms per token of one trial of `mode`."""
    P = len(prompt)
    if mode == "stepper":
        mx.synchronize()
        it = generate_step(mx.array(prompt), model, max_tokens=gen + 1, decoder=dec)
        next(it)
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        mx.synchronize()
        return 1e3 * (time.perf_counter() - t0) / max(n, 1)
    _reset(caches, P)
    y = mx.array([prompt[-1]])
    mx.eval(y)
    mx.synchronize()
    t0 = time.perf_counter()
    outs = []
    for _ in range(gen):
        lg = dec(y, caches)
        if mode == "chain_lse":
            lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
            y = mx.argmax(lp, axis=-1)
            outs.append(lp)
            mx.async_eval(y)
        elif mode == "chain":
            y = mx.argmax(lg, axis=-1)
            mx.async_eval(y)
        else:                            # fixed: the same token, the logits kept to the end
            outs.append(lg)
            mx.async_eval(lg)
    mx.eval(y, *outs[-1:])
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t0) / gen


def kernel_ms(model, caches, prompt, gen: int) -> float:
    """Mean of the kernel's own timer (ms) over gen steps, or -1 where it did not run."""
    lv = resolve("l3")                      # (the fast path's settings from the environment)
    dec = FastDecoder(FastStep(model, with_levers(lv, fast=replace(lv.fast, prof=True))))    # (the timer on)
    dec.reserve(caches, gen + 8)
    _reset(caches, len(prompt))
    y, tot = mx.array([prompt[-1]]), []
    for i in range(gen):
        lg = dec(y, caches)
        y = mx.argmax(lg, axis=-1)
        mx.eval(y)
        prof = dec.mega_profile()
        if prof and i >= 3:
            tot.append(prof["total"] / 1e3)
    return statistics.mean(tot) if tot else -1.0


def step_ops(dec, caches, tok) -> dict:
    f = io.StringIO()
    out = dec(tok, caches)
    lp = out - mx.logsumexp(out, axis=-1, keepdims=True)
    mx.export_to_dot(f, mx.argmax(lp, axis=-1), lp)
    mx.eval(out)
    return dict(Counter(re.findall(r'label\s*=\s*"([A-Za-z_0-9]+)"', f.getvalue())))


PARTS = (("kernel", "the kernel's phases"), ("around_kernel_ms", "around the kernel"),
         ("argmax_ms", "argmax"), ("logprobs_ms", "log-probabilities"), ("host_ms", "host"))


def report(files: list, out: Path) -> None:
    """overhead.md (a row per file: ms per token of each mode and each part) and overhead.png
    (each model's stepper time split into the parts, stacked)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    recs = []
    for f in files:
        r = json.loads(Path(f).read_text())
        recs.append({"model": r["model"], "prompt": r["prompt"], **r["ms_per_token"],
                     "kernel": r["kernel_ms"], **{k: r.get(k) for k, _ in PARTS[1:]}})
    df = pd.DataFrame(recs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.md").write_text(
        "ms per token (medians of the trials; `kernel`: the kernel's own timer, -1 where it did not"
        " run)\n\n" + md_table(list(df.columns), df.round(4).values.tolist()) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = None
    labels = [f"{m} @{p}" for m, p in zip(df["model"], df["prompt"])]
    for key, name in PARTS:
        vals = df[key].fillna(0).clip(lower=0).values
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = vals if bottom is None else bottom + vals
    ax.set_ylabel("ms per token")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--from-json" in argv:
        ap = argparse.ArgumentParser(description="table and plot of step_overhead JSON files")
        ap.add_argument("--from-json", nargs="+", required=True)
        ap.add_argument("--report", required=True)
        a = ap.parse_args(argv)
        report(a.from_json, Path(a.report))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.prompt < 2 or a.gen < 4 or a.trials < 1:
        ap.error("--prompt >= 2, --gen >= 4 and --trials >= 1")
    model = load_model(a.model)[0]
    prompt = [(7 * i + 3) % 1000 + 32 for i in range(a.prompt)]
    caches = model.make_cache()
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    dec = FastDecoder(FastStep(model, resolve("l3")))
    dec.reserve(caches, a.gen + 8)
    for m in MODES:                                   # warm-up: traces and kernels built
        timed(m, model, dec, caches, prompt, 8)
    res = {m: [] for m in MODES}
    for t in range(a.trials):
        for m in (MODES if t % 2 == 0 else MODES[::-1]):
            res[m].append(timed(m, model, dec, caches, prompt, a.gen))
    out = {"model": Path(a.model).name, "prompt": a.prompt, "gen": a.gen, "trials": a.trials,
           "device": str(mx.default_device()), "mega": bool(dec.stats.mega),
           "mega_env": mega_env(),
           "ms_per_token": {m: statistics.median(v) for m, v in res.items()},
           "kernel_ms": kernel_ms(model, caches, prompt, a.gen)}
    ms = out["ms_per_token"]
    out["around_kernel_ms"] = ms["fixed"] - out["kernel_ms"] if out["kernel_ms"] > 0 else None
    out["argmax_ms"] = ms["chain"] - ms["fixed"]
    out["logprobs_ms"] = ms["chain_lse"] - ms["chain"]
    out["host_ms"] = ms["stepper"] - ms["chain_lse"]
    if a.ops:
        _reset(caches, a.prompt)
        out["ops"] = step_ops(dec, caches, mx.array([prompt[-1]]))
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
