"""Where the time goes while rows join a batch: each Engine step's wall time, in process.

B requests (random prompts of --prompt tokens, greedy, EOS banned, --gen tokens each) are
submitted at once to an Engine (--tier, max_batch B) and stepped to the end; for every step
we print its wall time (the step returned, its outputs' tokens on the host), how many
requests have their first token, how many tokens it emitted, and the fast runner's counters
(traces made so far, whether the one kernel ran). A first pass warms up (kernels compiled,
shapes traced); the second is printed.

    python experiments/join_timeline.py --model DIR [--rows 16] [--prompt 64] [--gen 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine  # noqa: E402
from engine.levers import resolve  # noqa: E402
from experiments.bench_rows import submit_rows  # noqa: E402


def one_pass(eng, rows, prompt, gen, seed, show):
    submit_rows(eng, rows, prompt, gen, seed)
    started, i, t0 = set(), 0, time.perf_counter()
    while eng.has_unfinished():
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        toks = sum(len(o.token_ids) for o in outs)
        started.update(o.request_id for o in outs if o.token_ids)
        fast = eng.stats().get("fast") or {}
        if show and (i < 48 or i % 16 == 0):
            print(json.dumps({"step": i, "ms": round(dt * 1e3, 2), "started": len(started), "tokens": toks,
                              "traces": fast.get("traces"), "mega": fast.get("mega"),
                              "t_s": round(time.perf_counter() - t0, 3)}), flush=True)
        i += 1
    return time.perf_counter() - t0, i


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tier", default="l3")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    a = ap.parse_args(argv)
    eng = Engine.load(a.model, max_batch=a.rows, levers=resolve(a.tier))
    one_pass(eng, a.rows, a.prompt, a.gen, 0, False)
    total, steps = one_pass(eng, a.rows, a.prompt, a.gen, 1, True)
    print(json.dumps({"tier": a.tier, "rows": a.rows, "total_s": round(total, 3), "steps": steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
