"""Where a speculating batch stalls: staggered arrivals, every engine step timed, a traceback
of the engine's thread for each step slower than `--slow-ms`.

Served at 8 clients with `--draft-model ... --draft-tier l3 --num-draft-tokens 8`
(`spec_bench.py`, H100), one request's first token came 4.9 s after it was sent while the
others streamed (`ttft_max_ms`), and no new trace of the draft's fast runner was made. Here the
same trained pair (`spec_bench.py --work DIR`, trained there when missing) runs in process:
`--rows` greedy requests, one submitted every `--gap` engine steps (as clients arrive), K draft
tokens, the draft's steps on the fast runner; `faulthandler` dumps the stack once a step runs
past `--slow-ms`, so the slow part names itself. Per step it keeps (rows decoding, wall ms,
tokens out, kernels MLX compiled during it); the JSON report lists the slow steps with their stacks (innermost frame first).

    python experiments/spec_stalls.py --work /tmp/specwork --k 8 --rows 8 --gap 3   # GPU
    python experiments/spec_stalls.py --quick                                       # CPU check
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import report_dir, write_run  # noqa: E402
from experiments.spec_bench import loaded_pair, prompts  # noqa: E402


def jit_files() -> int:
    """Kernels MLX's CUDA backend compiled and kept on disk so far (/tmp/mlx/<version>/ptx): a
    step that adds some compiled a kernel first seen there."""
    import glob
    import os
    return sum(len(os.listdir(d)) for d in glob.glob("/tmp/mlx/*/ptx"))


def run(target, tok, draft, k: int, rows: int, gap: int, gen: int, slow_ms: float, rounds: int,
        trace_dir: Path) -> dict:
    """`rounds` waves of `rows` staggered requests on one engine; the steps and the stalls."""
    from engine import Engine, SamplingParams, for_tier
    eng = Engine(target, tok, max_batch=rows, prompt_cache=None, draft_model=draft,
                 draft_levers=for_tier("l3"))
    params = SamplingParams(max_tokens=gen, temperature=0.0, num_draft_tokens=k, use_draft=True)
    steps, stalls = [], []
    trace_dir.mkdir(parents=True, exist_ok=True)
    for wave in range(rounds):
        pending = prompts(rows, gen, 100 + wave)
        i = 0
        while pending or eng.has_unfinished():
            if pending and i % gap == 0:
                eng.submit(pending.pop(), params)
            path = trace_dir / f"w{wave}-s{i}.txt"
            jit0 = jit_files()
            with open(path, "w") as f:
                faulthandler.dump_traceback_later(slow_ms / 1000, file=f)
                t0 = time.perf_counter()
                outs = eng.step()
                ms = 1000 * (time.perf_counter() - t0)
                faulthandler.cancel_dump_traceback_later()
            row = {"wave": wave, "step": i, "ms": round(ms, 2),
                   "rows": eng.stats().get("rows_now"), "tokens": sum(len(o.token_ids) for o in outs),
                   "jit": jit_files() - jit0}
            steps.append(row)
            text = path.read_text()
            if text.strip():
                stalls.append({**row, "stack": text.strip().splitlines()[:40]})   # (innermost first)
            else:
                path.unlink()
            i += 1
    spec = eng.stats()["speculation"]
    return {"k": k, "rows": rows, "gap": gap, "steps": len(steps),
            "ms_p50": sorted(s["ms"] for s in steps)[len(steps) // 2],
            "ms_max": max(s["ms"] for s in steps), "slowest": sorted(steps, key=lambda s: -s["ms"])[:10],
            "stalls": stalls, "draft_fast": spec.get("draft_fast"),
            "accepted": spec["draft"]["accepted"], "drafted": spec["draft"]["drafted"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="spec_bench's trained pair (trained when missing)")
    ap.add_argument("--target", default="1b")
    ap.add_argument("--steps", type=int, default=500, help="training steps (when missing)")
    ap.add_argument("--k", default="8", help="draft tokens, a comma list (one engine each)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--gap", type=int, default=3, help="engine steps between two arrivals")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="waves of --rows requests")
    ap.add_argument("--slow-ms", type=float, default=250.0)
    ap.add_argument("--quick", action="store_true", help="CPU check: small shapes, few steps")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="spec_stalls_"))
    if a.quick:
        a.steps, a.gen, a.rows, a.rounds = min(a.steps, 10), min(a.gen, 16), min(a.rows, 3), 1
    target, tok, draft = loaded_pair(a.target, work, a.steps, a.quick)
    out = Path(a.out) if a.out else report_dir("spec_stalls", a.tag)
    res = []
    for k in [int(x) for x in a.k.split(",")]:
        r = run(target, tok, draft, k, a.rows, a.gap, a.gen, a.slow_ms, a.rounds, out / f"traces-k{k}")
        res.append(r)
        print(json.dumps({x: r[x] for x in ("k", "rows", "steps", "ms_p50", "ms_max", "accepted",
                                             "drafted")} | {"stalls": len(r["stalls"])}), flush=True)
        for s in r["stalls"][:6]:
            print(json.dumps({x: s[x] for x in ("wave", "step", "ms", "rows", "jit")}), *s["stack"][1:6],
                  sep="\n  ", flush=True)
    write_run(out, "spec_stalls.py", argv, runs=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
