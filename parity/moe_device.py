"""`python -m parity.moe_device`: the MoE L1 checks that the CPU cannot run.

mlx's CPU `gather_mm` is float32-only, so the bfloat16 MoE grid (both engines)
runs on a GPU: for qwen3_moe and gemma4_moe in bfloat16, logits at the prefill
and 32 greedy decode steps for the short and long prompts, our token loop
against mlx-lm's `generate_step`, and one batched schedule against
`BatchGenerator`; with `--model DIR` (e.g. the `qwen3-moe` preset) the same
logits schedule on a model of real shapes. Everything is `mx.array_equal`.
Writes report.json and report.md to `--out`
(default reports/parity/<version>/h200-moe-bf16).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import mlx.core as mx

import engine
from . import checks
from .batch import Insert, compare, run_mlx_lm, run_ours
from .compare import run_schedule
from .fixtures.models import MOE, ensure_fixture
from .report import REPO, versions


def _forward_rows(dtype: str) -> list[dict]:
    rows = []
    for family in MOE:
        for prompt in checks.PROMPT_LENS:
            c = checks.ForwardCheck(family, dtype, prompt)
            t = time.time()
            cmp = checks.run_forward_check(c)
            got, expected = checks.run_generate_check(c)
            loop = [x for x, _ in got] == [x for x, _ in expected] and all(
                mx.array_equal(a, b).item() for (_, a), (_, b) in zip(got, expected))
            rows.append({**cmp.summary(), "kind": "forward", "generate_step_equal": loop,
                         "passed": cmp.equal and loop, "seconds": round(time.time() - t, 2)})
    return rows


def _batch_rows(dtype: str) -> list[dict]:
    from engine.loader import load_model
    from .oracles import mlx_lm_oracle as oracle

    rows = []
    for family in MOE:
        path = str(ensure_fixture(family, dtype))
        rng = random.Random(0)
        sched = [Insert(step, [rng.randrange(4, 1000) for _ in range(n)], gen)
                 for step, n, gen in ((0, 7, 12), (0, 40, 9), (2, 19, 15), (4, 60, 8))]
        t = time.time()
        ref = run_mlx_lm(oracle.load_model(path), sched, prefill_step_size=16)
        problems = compare(run_ours(load_model(path)[0], sched, prefill_step_size=16), ref)
        rows.append({"name": f"{family}-{dtype}-batch4", "kind": "batch", "equal": not problems,
                     "problems": [str(p) for p in problems[:3]], "passed": not problems,
                     "seconds": round(time.time() - t, 2)})
    return rows


def _model_row(model_dir: str, prompt_len: int) -> dict:
    from engine.loader import load_model
    from .oracles import mlx_lm_oracle as oracle

    ours, ref = load_model(model_dir)[0], oracle.load_model(model_dir)
    prompt = [16 + (i * 104729) % 1000 for i in range(prompt_len)]
    t = time.time()
    cmp = run_schedule(f"{Path(model_dir).name}-prompt{prompt_len}", ours, ours.make_cache(),
                       lambda c: None, ref, oracle.make_cache(ref), lambda c: None,
                       prompt, checks.DECODE_STEPS)
    return {**cmp.summary(), "kind": "model", "passed": cmp.equal,
            "seconds": round(time.time() - t, 2)}


def run(dtype: str, model_dirs: list[str]) -> dict:
    rows = _forward_rows(dtype) + _batch_rows(dtype)
    for m in model_dirs:
        rows += [_model_row(m, n) for n in (9, 128)]
    for r in rows:
        print(f"{'PASS' if r['passed'] else 'FAIL'} {r['name']}", flush=True)
    return {"versions": versions(), "dtype": dtype, "decode_steps": checks.DECODE_STEPS,
            "checks": rows, "passed": sum(r["passed"] for r in rows),
            "failed": sum(not r["passed"] for r in rows)}


def write(result: dict, out: Path, cmd: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=2))
    v = result["versions"]
    lines = [f"# MoE {result['dtype']} parity on {v['device']} — mlx-parity {v['mlx-parity']}", "",
             f"mlx {v['mlx']} · mlx-lm {v['mlx-lm']} · {v['machine']} · python {v['python']}", "",
             f"**{result['passed']} passed, {result['failed']} failed.** Forward rows: logits at the "
             f"prefill and {result['decode_steps']} greedy decode steps plus our token loop vs "
             "mlx-lm's generate_step; batch rows: 4 rows joining at steps 0/2/4 vs BatchGenerator; "
             "model rows: the logits schedule on a model of real shapes. All `mx.array_equal`.", "",
             f"Reproduce: `{cmd}`", "",
             "| check | kind | tensors | max abs diff | result |", "|---|---|---|---|---|"]
    for r in result["checks"]:
        diff = f"{r['max_abs_diff']:.3g}" if "max_abs_diff" in r else "—"
        lines.append(f"| {r['name']} | {r['kind']} | {r.get('checks', '—')} | {diff} | "
                     f"{'pass' if r['passed'] else '**FAIL**'} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="fixture dtype (float32 lets the CPU smoke-test this script)")
    p.add_argument("--model", action="append", default=[], help="extra MoE model dir (repeatable)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    result = run(a.dtype, a.model)
    out = Path(a.out) if a.out else REPO / "reports" / "parity" / engine.__version__ / "h200-moe-bf16"
    cmd = "python -m parity.moe_device " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    write(result, out, cmd.strip())
    print(json.dumps({"passed": result["passed"], "failed": result["failed"], "out": str(out)}))
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
