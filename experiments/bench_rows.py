"""In-process decode speed of the runners through the public `Engine` API, at several row counts.

For each tier (l1: the batch runner; l3: the fast runner) and each row count B, B requests
(random prompts of --prompt tokens, greedy, EOS banned, exactly --gen tokens each) are
submitted at once and stepped to the end; decode tok/s counts the tokens emitted over the
steps after the last request's first token (all B rows decoding). Best of --trials, tiers
alternating. No HTTP: the served figures are experiments/bench_batching.py's.

    python experiments/bench_rows.py --model DIR --rows 1,8,32 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import engine  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from engine.fast.config import FastConfig  # noqa: E402
from engine.levers import resolve  # noqa: E402

# the fast path's settings (MLXP_DISABLE_KERNELS, MLXP_MEGA_*) from the environment; the tier's
# levers themselves are not read from it (env={} above). Until 0.5.0 these were ignored too, so a
# run with MLXP_DISABLE_KERNELS=qmm measured the kernel it meant to switch off.
FAST_ENV = FastConfig.from_env(os.environ)
from experiments._common import add_one_kernel_flag, apply_one_kernel_flag, machine, write_csv  # noqa: E402


def submit_rows(eng, rows, prompt, gen, seed):
    """`rows` requests of random `prompt`-token prompts, greedy, EOS banned, `gen` tokens each."""
    rng = np.random.default_rng(seed)
    vocab = min(eng.vocab_size, 1000)
    bias = {int(t): -1e9 for t in eng.eos}
    for _ in range(rows):
        eng.submit(rng.integers(32, vocab, size=prompt).tolist(),
                   SamplingParams(max_tokens=gen, temperature=0.0, logit_bias=bias))


def run(eng, rows, prompt, gen, seed):
    submit_rows(eng, rows, prompt, gen, seed)
    started, t_all, n = set(), None, 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        outs = eng.step()
        for o in outs:
            if t_all is not None:
                n += len(o.token_ids)
            started.add(o.request_id)
        if t_all is None and len(started) == rows:
            t_all = time.perf_counter()
    t1 = time.perf_counter()
    return {"decode_tok_s": n / max(t1 - t_all, 1e-9), "total_s": t1 - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--tiers", default="l1,l3")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", required=True)
    add_one_kernel_flag(ap)
    a = ap.parse_args(argv)
    apply_one_kernel_flag(a)
    rows_list = [int(x) for x in a.rows.split(",")]
    tiers = a.tiers.split(",")
    engines = {}
    for t in tiers:
        model, tok = engine.load(a.model)
        engines[t] = Engine(model, tok, max_batch=max(rows_list), levers=resolve(t, env={}, fast=FAST_ENV))
    out = []
    for rows in rows_list:
        for t in tiers:                      # warm-up: this row count's shapes
            run(engines[t], rows, a.prompt, 8, 0)
        best = {t: None for t in tiers}
        for k in range(a.trials):
            for t in (tiers if k % 2 == 0 else tiers[::-1]):
                r = run(engines[t], rows, a.prompt, a.gen, k + 1)
                if best[t] is None or r["decode_tok_s"] > best[t]["decode_tok_s"]:
                    best[t] = r
        for t in tiers:
            fast = engines[t].stats()["fast"]
            row = {"model": Path(a.model).name, "rows": rows, "tier": t,
                   "decode_tok_s": round(best[t]["decode_tok_s"], 1),
                   "vs_l1": round(best[t]["decode_tok_s"] / best["l1"]["decode_tok_s"], 3)
                   if "l1" in best else None,
                   "traces": fast["traces"] if fast else None,
                   "mega": fast["mega"] if fast else None}
            out.append(row)
            print(json.dumps(row), flush=True)
    d = Path(a.out)
    d.mkdir(parents=True, exist_ok=True)
    write_csv(d / "bench_rows.csv", out, list(out[0]))
    (d / "machine.json").write_text(json.dumps(machine(), indent=2))


if __name__ == "__main__":
    main()
