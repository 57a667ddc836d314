"""Where an Engine decode step of B rows spends its time: the step's wall time, how much of
it is the batch decoder's call (host: tracing, building, queueing) and the wait for the GPU,
and Python's profile of the rest (scheduling, sampling, bookkeeping).

For each B: an Engine (max_batch=B, --spec levers) gets B prompts; after every row has
prefilled and WARM steps ran, STEPS decode steps are timed, first plain (ms per step, tok/s),
then under cProfile (the top functions by own time). The GPU's share is measured by timing
a step that ends in `mx.synchronize()` against the time the host spends before it waits.

    python experiments/batch_profile.py --model DIR --batches 8,32 [--spec l3] \
        [--steps 32] [--out FILE.json]
    python experiments/batch_profile.py --quick          # CPU dry run on a fixture
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

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.fast.apply import describe  # noqa: E402
from engine.levers import parse_spec  # noqa: E402


class _NoEos:
    """A tokenizer wrapper without EOS ids: rows run to max_tokens."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_token_ids = set()

    def __getattr__(self, name):
        return getattr(self._tok, name)


def profile_batch(model, tok, spec: str, B: int, prompt: int, steps: int, warm: int = 8) -> dict:
    vocab = model.args.vocab_size
    rng = np.random.default_rng(B)
    eng = engine.Engine(model, tok, max_batch=B, levers=parse_spec(spec))
    for _ in range(B):
        eng.submit(rng.integers(32, min(vocab, 1000) - 1, size=prompt).tolist(),
                   engine.SamplingParams(max_tokens=warm + 3 * steps + 4 + B, temperature=0.0))
    for _ in range(warm + B):            # prefill every row, then warm steps
        eng.step()
    mx.synchronize()
    plain = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        plain.append(time.perf_counter() - t)
    # the host's part: a step's time until it returns, then the wait for the queued work
    host, total = [], []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        t1 = time.perf_counter()
        mx.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t)
        total.append(t2 - t)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    mx.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return {"spec": spec, "B": B, "prompt": prompt, "steps": steps, "step_ms": round(med(plain), 3),
            "tok_s": round(B / (med(plain) / 1e3), 1), "host_ms_until_return": round(med(host), 3),
            "synced_step_ms": round(med(total), 3),
            "levers": describe(parse_spec(spec), model).get("fast_stats"),
            "profile_top": s.getvalue().splitlines()[:60]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--spec", default="l3")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.quick or not a.model:
        from parity.fixtures.models import ensure_fixture
        a.model = str(ensure_fixture("llama", "bfloat16"))
        a.steps, a.prompt = min(a.steps, 6), min(a.prompt, 16)
    model, tok = engine.load(a.model)
    rows = []
    for B in (int(b) for b in a.batches.split(",")):
        r = profile_batch(model, _NoEos(tok), a.spec, B, a.prompt, a.steps)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "profile_top"}), flush=True)
        print("\n".join(r["profile_top"][:45]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
