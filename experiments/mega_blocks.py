"""Whether the one-kernel step's slow blocks are the same ones layer after layer and step after
step (MLXP_MEGA_PROF=1, on a GPU). Each projection phase ends when its last block is done; if
the last ones are always the same blocks (the SMs they run on stream more slowly), giving
them less of each phase would shorten it; if they change from layer to layer, it would not.

For each phase, from the blocks' arrival stamps over --steps decode steps:
  phase_us       the sum over layers of the last block's arrival (what the phase waits for)
  mean_us        the sum over layers of the blocks' mean arrival
  slowest_us     the largest per-block sum over layers (one block always last: = phase_us)
  harmonic_us    the harmonic mean of the per-block sums: the phase's length if each block's
                 share were cut to its measured speed (the bound of a static rebalancing)
  layer_corr     Pearson correlation over blocks of their even-layer and odd-layer sums
                 (within a step; near 1: the same blocks are slow in every layer)
  step_corr      the same between the per-block sums of consecutive steps (near 1: the slow
                 blocks stay the slow ones from one launch to the next)
  slowest        the five block indices with the largest sums (over all steps)

    python experiments/mega_blocks.py --model DIR [--prompt 128] [--steps 8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pearson(a: list, b: list) -> float:
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return 0.0
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (va * vb) ** 0.5


def analyse(steps: list) -> dict:
    """`steps`: one {phase: [layer][block] µs} per step (MegaStep.block_arrivals)."""
    out = {}
    for ph in steps[0]:
        sums = [[sum(col) for col in zip(*st[ph])] for st in steps]         # [step][block]
        nb, L = len(sums[0]), len(steps[0][ph])
        mean_sum = [sum(s[b] for s in sums) / len(sums) for b in range(nb)]
        rec = {
            "phase_us": sum(sum(max(a) for a in st[ph]) for st in steps) / len(steps),
            "mean_us": sum(sum(sum(a) / nb for a in st[ph]) for st in steps) / len(steps),
            "slowest_us": max(mean_sum),
            "harmonic_us": nb / sum(1 / max(s, 1e-9) for s in mean_sum),
            "layer_corr": None, "step_corr": None,
            "slowest": sorted(range(nb), key=lambda b: -mean_sum[b])[:5],
        }
        if L >= 2:
            ev = [[sum(st[ph][l][b] for l in range(0, L, 2)) for b in range(nb)] for st in steps]
            od = [[sum(st[ph][l][b] for l in range(1, L, 2)) for b in range(nb)] for st in steps]
            rec["layer_corr"] = sum(pearson(e, o) for e, o in zip(ev, od)) / len(steps)
        if len(sums) >= 2:
            rec["step_corr"] = sum(pearson(a, b) for a, b in zip(sums, sums[1:])) / (len(sums) - 1)
        out[ph] = {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}
        out[ph]["per_block_us"] = [round(v, 2) for v in mean_sum]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    os.environ["MLXP_MEGA_PROF"] = "1"
    import mlx.core as mx

    from engine.fast.decode import FastDecoder
    from engine.levers import resolve
    from engine.loader import load_model

    model = load_model(a.model)[0]
    dec = FastDecoder(model, resolve("l3", env={}))
    caches = model.make_cache()
    prompt = [(7 * i + 3) % 1000 for i in range(a.prompt)]
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    y, steps = mx.array([prompt[-1]]), []
    for i in range(a.warm + a.steps):
        mx.eval(dec(y, caches))
        if not dec.stats.mega:
            print(f"the one-kernel step did not run: {dec.stats.mega_reason}", file=sys.stderr)
            return 1
        if i >= a.warm:
            steps.append(dec.mega_block_arrivals())
        y = mx.array([(11 * i + 5) % 1000])
    if not steps or not steps[0]:
        print("no per-block stamps (MLXP_MEGA_PROF did not reach the kernel)", file=sys.stderr)
        return 1
    res = {"device": mx.device_info().get("device_name", str(mx.default_device())),
           "prompt": a.prompt, "steps": a.steps, "phases": analyse(steps)}
    for ph, r in res["phases"].items():
        print(json.dumps({"phase": ph, **{k: v for k, v in r.items() if k != "per_block_us"}}))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
