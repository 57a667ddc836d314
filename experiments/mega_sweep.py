"""The one-kernel step's switches (MLXP_MEGA_OPT) A/B in one process, on a GPU: for each
variant and prompt length, the step's phase times (MLXP_MEGA_PROF, averaged over the timed
steps), its wall time per step, and its logits against the first variant's on the same tokens
(teacher-forced).

A variant is `MASK`, a sum of engine.fast.mega.OPT_BITS: 1 o_proj prefetch during attention,
2 cached keys/values prefetched in phase A, 4 weight loads evict-first in L2, 8 q/k/v split in
two halves of H, 16 barrier arrival as one release-add, 32 units dealt across blocks first,
64 acquire/release hand-offs without extra fences, 128 no o_proj prefetch in attention, 256 a
unit's keys/values prefetched, 512 attention started per head on flags instead of a barrier,
4096 the prefetch of a warp's next unit capped at 16 KB. Every variant shares one compiled
kernel (the mask is an input). (Compile-time variants of the kernel, since measured and taken
out, are listed in reports/l3/JOURNAL.md with the commit that last had them.)

    python experiments/mega_sweep.py --model DIR --variants 0,1,2,4,8,15 --prompts 128,2048 \
        [--steps 24] [--out FILE.json]
    python experiments/mega_sweep.py --from-json FILE.json [FILE2.json ...] --report DIR
        # a table (sweep.md, pandas) and a plot of the phases (sweep.png, matplotlib)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast.decode import FastDecoder  # noqa: E402
from engine.fast.mega import PHASES  # noqa: E402
from experiments._common import md_table  # noqa: E402
from engine.levers import resolve  # noqa: E402
from engine.loader import load_model  # noqa: E402


# the kernel settings a variant names; the others are unset while it runs, whatever the
# environment holds, so that a variant is the kernel it names
SETTINGS = ("MLXP_MEGA_OPT",)


def parse_variant(spec: str) -> dict:
    """'596' -> {'MLXP_MEGA_OPT': '596'}."""
    mask, *rest = spec.split(":")
    if rest:
        raise ValueError(f"unknown setting {rest[0]!r} in variant {spec!r} (a variant is a mask)")
    return {"MLXP_MEGA_OPT": str(int(mask))}


def run_variant(model, prompt, seq, env: dict, warm: int = 3):
    """(logits [steps, V], mean phase µs, wall ms per step) of one variant."""
    # (only the variant's settings and the phase timer, whatever the environment holds)
    levers = resolve("l3", env={"MLXP_MEGA_PROF": "1", **env})
    dec = FastDecoder(model, levers)
    caches = model.make_cache()
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    y = mx.array([prompt[-1]])
    out, profs, walls = [], [], []
    for i, t in enumerate(seq):
        t0 = time.perf_counter()
        lg = dec(y, caches)
        mx.eval(lg)
        walls.append(time.perf_counter() - t0)
        out.append(lg.reshape(-1))
        if i >= warm and dec.mega_profile():
            profs.append(dec.mega_profile())
        y = mx.array([t])
    if not dec.stats.mega:
        raise RuntimeError(f"the one-kernel step did not run: {dec.stats.mega_reason}")
    prof = _mean(profs) if profs else {}
    wall = sorted(walls[warm:])[len(walls[warm:]) // 2] * 1e3
    return mx.stack(out), prof, round(wall, 3)


def _mean(dicts: list) -> dict:
    """Key by key mean of the steps' profiles (nested: the blocks' arrivals)."""
    return {k: _mean([d[k] for d in dicts]) if isinstance(v, dict) else round(sum(d[k] for d in dicts) / len(dicts), 2)
            for k, v in dicts[0].items()}


def _cmp(a, b) -> dict:
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    lp = b32 - mx.logsumexp(b32, axis=-1, keepdims=True)
    lq = a32 - mx.logsumexp(a32, axis=-1, keepdims=True)
    kl = mx.mean(mx.sum(mx.exp(lp) * (lp - lq), axis=-1)).item()
    top1 = mx.mean(mx.argmax(a32, -1) == mx.argmax(b32, -1)).item()
    rel = (mx.linalg.norm((a32 - b32).reshape(-1)) / mx.linalg.norm(b32.reshape(-1))).item()
    return {"mean_kl": kl, "top1": top1, "rel_err": rel, "identical": bool(mx.array_equal(a, b).item())}


# errors after which the process's CUDA context is unusable (a kernel that trapped: the spin
# guard of a flag that never came, 10 s; a bad address)
STICKY = ("illegal instruction", "illegal memory access", "misaligned address", "unspecified launch failure")


def report(files: list, out: Path) -> None:
    """sweep.md (one row per file, prompt, variant: phase µs, total, wall, top-1 against the
    file's first variant) and sweep.png (stacked phases per variant)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    recs = []
    for f in files:
        for r in json.loads(Path(f).read_text())["rows"]:
            if "error" in r:
                continue
            recs.append({"run": Path(f).stem, "prompt": r["prompt"], "variant": r["variant"],
                         **{k: r["profile_us"].get(k) for k in (*PHASES, "total")},
                         "wall_ms": r["wall_ms"], "top1_vs_first": round(r["vs_first"]["top1"], 3)})
    arrivals = [{"run": Path(f).stem, "prompt": r["prompt"], "variant": r["variant"],
                 **{ph: "{min} / {median} / {max}".format(**r["profile_us"]["arrive"][ph]) for ph in PHASES}}
                for f in files for r in json.loads(Path(f).read_text())["rows"]
                if "error" not in r and "arrive" in r["profile_us"]]
    df = pd.DataFrame(recs)
    out.mkdir(parents=True, exist_ok=True)
    text = ("µs per step (phase times summed over the layers, mean over the timed steps); wall: "
            "median ms per step\n\n" + md_table(list(df.columns), df.values.tolist()) + "\n")
    if arrivals:
        da = pd.DataFrame(arrivals)
        text += ("\nWhen the blocks had done their share of each phase: first / median / last block, "
                 "µs after the phase's start, summed over the layers\n\n"
                 + md_table(list(da.columns), da.values.tolist()) + "\n")
    (out / "sweep.md").write_text(text)
    fig, axes = plt.subplots(1, max(1, len(df.groupby(["run", "prompt"]))), figsize=(14, 4.5), squeeze=False)
    for ax, ((run, prompt), g) in zip(axes[0], df.groupby(["run", "prompt"])):
        bottom = None
        for ph in PHASES:
            ax.bar(g["variant"].astype(str), g[ph], bottom=bottom, label=ph)
            bottom = g[ph].values if bottom is None else bottom + g[ph].values
        ax.set_title(f"{run}, prompt {prompt}")
        ax.set_xlabel("MLXP_MEGA_OPT")
        ax.set_ylabel("µs per step")
        ax.tick_params(axis="x", rotation=45)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--from-json", nargs="+", help="build the report from these results, run nothing")
    ap.add_argument("--report", help="with --from-json: write sweep.md and sweep.png here")
    ap.add_argument("--variants", default="0,1,2,4,8,15")
    ap.add_argument("--prompts", default="128")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.from_json:
        if not a.report:
            ap.error("--from-json needs --report DIR")
        report(a.from_json, Path(a.report))
        return 0
    if not a.model:
        ap.error("--model DIR (on a GPU), or --from-json FILE --report DIR")
    return sweep(a)


def sweep(a) -> int:
    """The variants x prompts of the parsed arguments `a`, with the phase timer on."""
    model = load_model(a.model)[0]
    vocab = model.args.vocab_size
    specs = a.variants.split(",")
    rows = []

    def save():     # (after every variant: a kernel that stops the process keeps what came before)
        if a.out:
            Path(a.out).write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=1))
    for plen in (int(p) for p in a.prompts.split(",")):
        prompt = [(7 * i + 3) % (vocab - 1) + 1 for i in range(plen)]
        seq = [(11 * i + 5) % (vocab - 1) + 1 for i in range(a.steps)]
        base = None
        for spec in specs:
            try:
                lg, prof, wall = run_variant(model, prompt, seq, parse_variant(spec))
            except Exception as e:  # noqa: BLE001  (a variant that fails is reported, not fatal)
                rows.append({"prompt": plen, "variant": spec, "error": f"{type(e).__name__}: {e}"})
                print(json.dumps(rows[-1]), flush=True)
                save()
                if any(m in str(e) for m in STICKY):   # the CUDA context is lost: nothing after runs
                    print(f"mega_sweep: stopped after {spec!r} at prompt {plen} (the GPU context is lost);"
                          " run the variants after it in another process", flush=True)
                    return 3
                continue
            if base is None:
                base = lg
            rows.append({"prompt": plen, "variant": spec, "wall_ms": wall, "profile_us": prof,
                         "vs_first": _cmp(lg, base)})
            print(json.dumps(rows[-1]), flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
