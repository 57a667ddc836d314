"""A burst of long prompts beside a decoding stream: the stream's worst wait between tokens.

One greedy request decodes (the innocent stream); then --burst prompts of --length tokens
arrive at once. Each Engine.step is timed while the innocent request is unfinished; reported:
its worst and median gap between tokens, per `--budgets` setting of `Engine(prefill_budget=)`
(-1: the default, prefill_step_size shared by the prompts prefilling; 0: a chunk per prompt,
mlx-lm's BatchGenerator schedule). In process, any model.

    python experiments/prefill_burst.py --model DIR [--burst 32 --length 4000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, SamplingParams  # noqa: E402
from engine.loader import load  # noqa: E402
from experiments._common import machine, report_dir  # noqa: E402


def run(model, tok, budget, a):
    eng = Engine(model, tok, max_batch=a.burst + 1, prefill_budget=budget, prompt_cache=None,
                 prefill_step_size=a.step)
    rng = np.random.default_rng(0)
    bias = {int(t): -1e9 for t in eng.eos}
    inn = eng.submit(rng.integers(4, 900, size=32).tolist(),
                     SamplingParams(max_tokens=a.innocent, temperature=0.0, logit_bias=bias))
    for _ in range(4):                          # the innocent stream is decoding
        eng.step()
    for _ in range(a.burst):
        eng.submit(rng.integers(4, 900, size=a.length).tolist(),
                   SamplingParams(max_tokens=4, temperature=0.0, logit_bias=bias))
    gaps, last, done = [], time.perf_counter(), False
    while eng.has_unfinished() and not done:
        for o in eng.step():
            if o.request_id == inn:
                now = time.perf_counter()
                if o.token_ids:
                    gaps.append(now - last)
                    last = now
                done = o.finish_reason is not None
    while eng.has_unfinished():
        eng.step()
    return {"budget": eng.prefill_budget, "innocent_tokens": len(gaps),
            "worst_gap_s": round(max(gaps), 3), "median_gap_s": round(statistics.median(gaps), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--step", type=int, default=2048, help="prefill_step_size")
    ap.add_argument("--innocent", type=int, default=400, help="the innocent stream's tokens")
    ap.add_argument("--budgets", default="0,-1")
    ap.add_argument("--tag", default="cpu")
    a = ap.parse_args(argv)
    model, tok = load(a.model)
    rows = []
    for b in [int(x) for x in a.budgets.split(",")]:
        rows.append(run(model, tok, b, a))
        print(json.dumps(rows[-1]), flush=True)
    out = report_dir("prefill_burst", a.tag)
    cmd = "python experiments/prefill_burst.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "run.json").write_text(json.dumps({"command": cmd, "args": vars(a), "machine": machine(),
                                              "rows": rows}, indent=2))
    lines = [f"# Prefill burst beside a decoding stream\n\nCommand: `{cmd}`\n",
             "| prefill_budget | innocent tokens | worst gap s | median gap s |", "|---|---|---|---|"]
    lines += [f"| {r['budget']} | {r['innocent_tokens']} | {r['worst_gap_s']} | {r['median_gap_s']} |"
              for r in rows]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
