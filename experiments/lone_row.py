"""A lone request on a batching Engine against the same request on `max_batch=1`, in process.

One request (random prompt of --prompt tokens, greedy, EOS banned, --gen tokens) on
`Engine(max_batch=B)` (a batch row) and on `Engine(max_batch=1)` (the exact runner): tok/s of
each after a warm-up pass; whether the two give the same tokens and logprobs (a greedy
request, its top-20 logprobs at every step, compared as floats); with --profile the functions where each spends its host time
(cProfile, top --top by own time). What "a lone client within 5% of our own --batch 1" costs.

    python experiments/lone_row.py --model DIR [--batch 32] [--gen 256] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, SamplingParams  # noqa: E402
from experiments.bench_rows import submit_rows  # noqa: E402


def run(eng, prompt, gen, seed):
    submit_rows(eng, 1, prompt, gen, seed)
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        n += sum(len(o.token_ids) for o in eng.step())
    return n / (time.perf_counter() - t0)


def tokens_and_logprobs(eng, prompt, gen):
    """One greedy request's tokens and their (top-20) logprobs, as the engine returns them."""
    rid = eng.submit(list(range(40, 40 + prompt)),
                     SamplingParams(max_tokens=gen, temperature=0.0, logprobs=True, top_logprobs=20))
    toks, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.token_ids
                lps += o.logprobs
    return toks, lps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    seqs = {}
    for b in (1, a.batch):
        eng = Engine.load(a.model, max_batch=b)
        seqs[b] = tokens_and_logprobs(eng, a.prompt, 64)
        run(eng, a.prompt, a.gen, 0)
        tps = [run(eng, a.prompt, a.gen, 1 + t) for t in range(a.trials)]
        print(json.dumps({"max_batch": b, "tok_s": [round(x, 1) for x in tps]}), flush=True)
        if a.profile:
            pr = cProfile.Profile()
            pr.enable()
            run(eng, a.prompt, a.gen, 9)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
            print(f"--- max_batch={b} profile\n" + s.getvalue()[-6000:], flush=True)
    same = seqs[1] == seqs[a.batch]
    print(json.dumps({"lone_row_equals_batch1": same, "tokens": len(seqs[1][0])}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
