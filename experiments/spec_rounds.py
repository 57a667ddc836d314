"""Where a speculation round's time goes, in process (the cost model behind spec_bench's ratios).

On the target and draft `spec_bench.py` trained (its `--work` directory; trained there when
missing), `--rows` greedy requests at a time (default one) on an `Engine` (max_batch 4 or
`--rows`), four ways: plain decoding, prompt lookup, draft model, and the draft model's steps
on the fast runner (`fastdraft`: `draft_levers=for_tier("l3")`, engine/step/fast_draft.py). Per way: tokens a second, tokens a step, and the
mean wall time of an engine step; then, with the device synchronised around each part (which
removes their overlap, so the parts add up to more than a step), the draft model's K forwards
(`DraftBatch.propose`) and the verify forward with its host reads (`LookupSteps._lookup_step`
minus the draft); and without synchronising, a round's host time in the draft's proposal,
in building the verify forward, waiting for it (`mx.eval`) and the rest (`host_*_ms`). A
plain step that costs s and a round that costs r handing out t tokens break even at t = r / s.

    python experiments/spec_rounds.py --work /tmp/specwork [--k 4] [--gen 128] [--rows 1,8]   # GPU
    python experiments/spec_rounds.py --quick                                     # CPU check

Prints one JSON line a way and writes `--out` (default reports/spec_rounds/<version>/<tag>/).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import report_dir, write_run  # noqa: E402
from experiments.presets import PRESETS  # noqa: E402
from experiments.spec_bench import loaded_pair, prompts  # noqa: E402


def _timed(cls, name: str, spent: dict, key=None, sync: bool = True):
    """Wrap cls.name so its calls' wall time adds up in spent[key or name]: with the device
    synchronised around each call (`sync`), or not (the host's own time, and any wait inside)."""
    import mlx.core as mx
    real = getattr(cls, name)

    def wrapper(self, *a, **kw):
        if sync:
            mx.synchronize()
        t0 = time.perf_counter()
        out = real(self, *a, **kw)
        if sync:
            mx.synchronize()
        spent[key or name] = spent.get(key or name, 0.0) + time.perf_counter() - t0
        return out
    setattr(cls, name, wrapper)
    return real


class _WaitTimed:
    """Stands for `mlx.core` in engine.step.batch_lookup: its `eval` (where a verify round
    waits for the verify forward) timed into spent["wait"]."""

    def __init__(self, real, spent: dict):
        self._real, self._spent = real, spent

    def __getattr__(self, name):
        return getattr(self._real, name)

    def eval(self, *a):
        t0 = time.perf_counter()
        self._real.eval(*a)
        self._spent["wait"] = self._spent.get("wait", 0.0) + time.perf_counter() - t0


def way(target, tok, draft, mode: str, k: int, gen: int, n: int, parts, rows: int = 1,
        tier: str = "l1") -> dict:
    """parts: False (wall time only), True (each part with the device synchronised around
    it) or "host" (no synchronisation: a round's host time in the draft's proposal, in
    building the verify forward, waiting for it, and the rest). tier: the target's runner
    (l1: the batch runner; l3: the fast runner, whose verify is `SlotPool.verify`)."""
    import mlx.core as mx

    from engine import Engine, SamplingParams, for_tier
    from engine.step import batch_lookup
    from engine.step.batch import BatchScheduler
    from engine.step.batch_draft import DraftBatch
    from engine.step.batch_lookup import LookupSteps
    from engine.fast.slots import SlotPool
    drafting = mode in ("draft", "fastdraft")
    eng = Engine(target, tok, max_batch=max(4, rows), prompt_cache=None,
                 levers=for_tier("l3") if tier == "l3" else None,
                 draft_model=draft if drafting else None,
                 draft_levers=for_tier("l3") if mode == "fastdraft" else None)
    params = SamplingParams(max_tokens=gen, temperature=0.0, num_draft_tokens=k,
                            prompt_lookup=3 if mode == "lookup" else 0,
                            use_draft=drafting)
    spent: dict = {}
    saved = []
    if parts == "host":
        saved = [(cls, name, _timed(cls, name, spent, key, sync=False)) for cls, name, key in
                 ((DraftBatch, "propose", "propose"), (BatchScheduler, "_forward", "build"),
                  (SlotPool, "verify", "build"), (LookupSteps, "_lookup_step", "round"))]
        batch_lookup.mx = _WaitTimed(mx, spent)
    elif parts:
        saved = [(DraftBatch, "propose", _timed(DraftBatch, "propose", spent)),
                 (LookupSteps, "_lookup_step", _timed(LookupSteps, "_lookup_step", spent))]
    try:
        steps, toks, wall = 0, 0, 0.0
        ps = prompts((n + 1) * rows, gen, 7)
        for i in range(n + 1):                # (`rows` requests at a time)
            if i == 1:
                spent.clear()                 # (parts of the measured requests only)
            for p in ps[i * rows:(i + 1) * rows]:
                eng.submit(p, params)
            mx.synchronize()
            t0 = time.perf_counter()
            while eng.has_unfinished():
                got = sum(len(o.token_ids) for o in eng.step())
                if i:                         # (the first request warms up)
                    steps, toks = steps + 1, toks + got
            if i:
                wall += time.perf_counter() - t0
    finally:
        for cls, name, real in saved:
            setattr(cls, name, real)
        batch_lookup.mx = mx
    row = {"mode": mode, "tier": tier, "parts": parts, "rows": rows, "tok_s": round(toks / wall, 1),
           "tokens_a_step": round(toks / max(steps, 1), 2),
           "step_ms": round(1000 * wall / max(steps, 1), 3)}
    if parts == "host":
        per = max(steps, 1)
        ms = {key: 1000 * spent.get(key, 0.0) / per for key in ("propose", "build", "wait", "round")}
        row.update({f"host_{key}_ms": round(v, 3) for key, v in ms.items()})
        row["host_rest_ms"] = round(ms["round"] - ms["propose"] - ms["build"] - ms["wait"], 3)
    elif parts:
        per = max(steps, 1)
        draft_ms = 1000 * spent.get("propose", 0.0) / per
        row["draft_ms_a_step"] = round(draft_ms, 3)
        row["verify_ms_a_step"] = round(1000 * spent.get("_lookup_step", 0.0) / per - draft_ms, 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="spec_bench's trained models (made if missing)")
    ap.add_argument("--target", default="1b")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=4, help="spec_bench's --draft-layers")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--rows", default="1", help="requests decoding together, a comma list "
                    "(each way runs at each; tokens a step count every row's)")
    ap.add_argument("--inflate", default=None, choices=sorted(PRESETS), help="spec_bench's --inflate")
    ap.add_argument("--tier", default="l1", choices=("l1", "l3"),
                    help="the target's runner: l1 (the batch runner) or l3 (the fast runner)")
    ap.add_argument("--modes", default="lookup,draft,fastdraft", help="plain (always) and which of these")
    ap.add_argument("--quick", action="store_true", help="CPU check: small shapes, few steps")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="spec_rounds_"))
    if a.quick:
        a.steps, a.gen, a.requests = min(a.steps, 10), min(a.gen, 24), 1
    target, tok, draft = loaded_pair(a.target, work, a.steps, a.quick, a.draft_layers, a.inflate)
    rows = []
    for n_rows in [int(x) for x in a.rows.split(",")]:
        for mode in ("plain",) + tuple(m for m in ("lookup", "draft", "fastdraft")
                                       if m in a.modes.split(",")):
            for parts in ((False,) if mode == "plain" else (False, True, "host")):
                rows.append(way(target, tok, draft, mode, a.k, a.gen, a.requests, parts, n_rows,
                                a.tier))
                print(json.dumps(rows[-1]), flush=True)
    write_run(Path(a.out) if a.out else report_dir("spec_rounds", a.tag), "spec_rounds.py", argv,
              rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
