"""Batch sensitivity: is a request's output the same alone (B=1) and inside a batch?

    python experiments/batch_invariance.py --quick            # CPU fixtures, ~2 min
    python experiments/batch_invariance.py --deterministic --tag cpu-deterministic
    python experiments/batch_invariance.py --families llama,gemma4_text --dtypes float32 \
        --sizes 2,4,8,16 --trials 10 --tokens 24 --tag my-run [--out DIR]

For each model, each batch size B and each trial: a random target request
(prompt length, content) is run alone through `engine.step.batch.BatchScheduler`
(greedy), then again among B-1 random filler requests (random prompt lengths
and max_tokens, random join steps, the target at a random position in the
admission order). The target is teacher-forced to its B=1 tokens, so every
step's logprob vector is compared even after a greedy flip would have
happened. Reported per (model, dtype, B): the fraction of steps whose full
logprob vector is bitwise equal (`mx.array_equal`), the fraction of trials
with every step equal, max |Δlogprob| (over all vocab entries and steps) and
the top-1 agreement (batched argmax == B=1 token).

Controls, per model: a B=1 rerun (must be bitwise equal: determinism) and a
negative control — the same B=1 run with one weight tensor (layer 0
down_proj) moved by one ulp, which must show inequality; if it did not, the
equality figures above would mean nothing.

Writes batch_invariance.{csv,md,json} to reports/batch_invariance/<version>/<tag>/
(or --out). The engine only; no mlx-lm needed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402

from experiments._common import dump_json, machine, md_table, report_dir, write_csv  # noqa: E402

FIELDS = ["model", "dtype", "B", "trials", "steps", "bitwise_steps", "bitwise_rate",
          "trials_all_bitwise", "max_abs_dlogprob", "top1_agree", "seconds"]


def _forced(tokens):
    it = iter(tokens)

    def sampler(logprobs, key=None):
        return mx.array([next(it, 0)] * logprobs.shape[0], dtype=mx.uint32)  # one extra (pipelined)
    return sampler


DETERMINISTIC = False    # --deterministic: the scheduler's deterministic mode (engine.deterministic)


def run(model, target, n_tokens, *, fillers=(), target_step=0, target_pos=0, forced=None,
        prefill_step_size=32):
    """The target's per-step logprobs [(V,)...] (and tokens) with fillers around it.
    fillers: [(join_step, prompt, max_tokens)]; target joins at target_step, at
    position target_pos among the requests joining at that step."""
    from engine.step.batch import BatchRequest, BatchScheduler
    sched = BatchScheduler(model, eos_token_ids=(), prefill_step_size=prefill_step_size,
                           deterministic=DETERMINISTIC)
    by_step = {}
    for s, p, m in fillers:
        by_step.setdefault(s, []).append(BatchRequest(p, max_tokens=m))
    tgt = BatchRequest(target, max_tokens=n_tokens,
                       sampler=_forced(forced) if forced is not None else None)
    lst = by_step.setdefault(target_step, [])
    lst.insert(min(target_pos, len(lst)), tgt)
    uid = None
    toks, lps = [], []
    last = max(by_step)
    step = 0
    while step <= last or sched.has_work():
        for req in by_step.get(step, ()):
            u = sched.submit(req)
            if req is tgt:
                uid = u
        for ev in sched.step():
            if ev.uid == uid and ev.token is not None:
                toks.append(ev.token)
                lps.append(ev.logprobs)
        step += 1
    return toks, lps


def _diff(a_lps, b_lps, ref_tokens):
    eq, dmax, top1 = 0, 0.0, 0
    for a, b, t in zip(a_lps, b_lps, ref_tokens):
        if mx.array_equal(a, b).item():
            eq += 1
        else:
            d = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
            d = mx.where(mx.isnan(d), mx.inf, d)   # -inf vs -inf gives nan: equal, skip
            fin = mx.isfinite(a.astype(mx.float32)) | mx.isfinite(b.astype(mx.float32))
            dmax = max(dmax, mx.max(mx.where(fin, d, 0.0)).item())
        top1 += int(mx.argmax(a).item() == t)
    return eq, dmax, top1


def _perturbed(model):
    """One weight tensor moved by one ulp (in place; returns an undo function)."""
    layer = model.layers[0]
    w = layer.mlp.down_proj.weight
    iv = {mx.float32: mx.int32, mx.bfloat16: mx.uint16, mx.float16: mx.uint16}[w.dtype]
    layer.mlp.down_proj.weight = (w.view(iv) + 1).view(w.dtype)

    def undo():
        layer.mlp.down_proj.weight = w
    return undo


def measure(model, name, dtype, sizes, trials, n_tokens, max_prompt, seed):
    rng = random.Random(seed)
    rows = []
    cases = []
    for t in range(trials):
        target = [rng.randrange(4, 1000) for _ in range(rng.randint(2, max_prompt))]
        ref_toks, ref_lps = run(model, target, n_tokens)
        cases.append((target, ref_toks, ref_lps))
    # controls
    t0 = time.time()
    eq = dmax = steps = top1 = 0
    for target, ref_toks, ref_lps in cases:
        _, lps = run(model, target, n_tokens, forced=ref_toks)
        e, d, t1 = _diff(lps, ref_lps, ref_toks)
        eq, dmax, steps, top1 = eq + e, max(dmax, d), steps + len(lps), top1 + t1
    rows.append(dict(model=name, dtype=dtype, B="1 (rerun)", trials=trials, steps=steps,
                     bitwise_steps=eq, bitwise_rate=eq / steps, trials_all_bitwise=None,
                     max_abs_dlogprob=dmax, top1_agree=top1 / steps,
                     seconds=round(time.time() - t0, 1)))
    t0 = time.time()
    undo = _perturbed(model)
    try:
        eq = dmax = steps = top1 = 0
        for target, ref_toks, ref_lps in cases:
            _, lps = run(model, target, n_tokens, forced=ref_toks)
            e, d, t1 = _diff(lps, ref_lps, ref_toks)
            eq, dmax, steps, top1 = eq + e, max(dmax, d), steps + len(lps), top1 + t1
    finally:
        undo()
    rows.append(dict(model=name, dtype=dtype, B="1 (+1 ulp, negative control)", trials=trials,
                     steps=steps, bitwise_steps=eq, bitwise_rate=eq / steps,
                     trials_all_bitwise=None, max_abs_dlogprob=dmax, top1_agree=top1 / steps,
                     seconds=round(time.time() - t0, 1)))
    for B in sizes:
        t0 = time.time()
        eq = dmax = steps = top1 = all_eq = 0
        for target, ref_toks, ref_lps in cases:
            fillers = [(rng.randint(0, 3), [rng.randrange(4, 1000)
                                            for _ in range(rng.randint(1, max_prompt + 16))],
                        rng.randint(1, 2 * n_tokens)) for _ in range(B - 1)]
            tstep = rng.randint(0, 3)
            tpos = rng.randint(0, B - 1)
            toks, lps = run(model, target, n_tokens, fillers=fillers, target_step=tstep,
                            target_pos=tpos, forced=ref_toks)
            assert toks == ref_toks, "teacher forcing failed"
            e, d, t1 = _diff(lps, ref_lps, ref_toks)
            eq, dmax, steps, top1 = eq + e, max(dmax, d), steps + len(lps), top1 + t1
            all_eq += int(e == len(lps))
        rows.append(dict(model=name, dtype=dtype, B=B, trials=trials, steps=steps,
                         bitwise_steps=eq, bitwise_rate=eq / steps,
                         trials_all_bitwise=all_eq / trials, max_abs_dlogprob=dmax,
                         top1_agree=top1 / steps, seconds=round(time.time() - t0, 1)))
        print(f"{name} {dtype} B={B}: bitwise {eq}/{steps}, max|d| {dmax:.3g}, "
              f"top1 {top1}/{steps} ({time.time() - t0:.1f}s)", flush=True)
    return rows


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if v and (abs(v) < 1e-2 or abs(v) >= 1e3) else f"{v:.3f}".rstrip("0").rstrip(".") if v else "0"
    return "—" if v is None else str(v)


def write(rows, out: Path, header: str):
    write_csv(out / "batch_invariance.csv", rows, FIELDS)
    dump_json(out / "batch_invariance.json", {"rows": rows, "machine": machine(), "header": header})
    table = md_table(["model", "dtype", "B", "trials", "steps", "bitwise steps", "bitwise rate",
                      "trials all bitwise", "max abs Δlogprob", "top-1 agree"],
                     [[r["model"], r["dtype"], r["B"], r["trials"], r["steps"], r["bitwise_steps"],
                       _fmt(r["bitwise_rate"]), _fmt(r["trials_all_bitwise"]),
                       _fmt(r["max_abs_dlogprob"]), _fmt(r["top1_agree"])] for r in rows])
    text = ["# Batch sensitivity: B=1 vs the same request inside a batch", "", header, "",
            "Each trial: a random target prompt run alone (greedy), then among B-1 random fillers "
            "(random prompt lengths / max_tokens / join steps, random position), teacher-forced to "
            "its B=1 tokens. A step is *bitwise* when its whole logprob vector is `mx.array_equal` "
            "to B=1. Controls: `1 (rerun)` must be 1.0; `1 (+1 ulp)` (one weight tensor moved by "
            "one ulp) must be < 1.0.", "", table, ""]
    (out / "batch_invariance.md").write_text("\n".join(text))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU fixtures, 3 trials, 12 tokens")
    ap.add_argument("--model", action="append", help="model dir (repeatable); default: fixtures")
    ap.add_argument("--families", default="llama,qwen3,minicpm,gemma4_text,gemma4")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sizes", default="2,4,8,16")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--deterministic", action="store_true",
                    help="every run in deterministic mode (sliding windows in temporal order)")
    a = ap.parse_args(argv)
    global DETERMINISTIC
    DETERMINISTIC = a.deterministic
    if a.quick:
        a.trials, a.tokens, a.max_prompt = 3, 12, 40
    sizes = [int(x) for x in a.sizes.split(",")]
    from engine.loader import load_model
    models = []
    for m in a.model or []:
        models.append((Path(m).name, None, m))
    if not a.model:
        from parity.fixtures.models import ensure_fixture
        for f in a.families.split(","):
            for d in a.dtypes.split(","):
                models.append((f, d, str(ensure_fixture(f, d))))
    rows = []
    t0 = time.time()
    for name, dtype, path in models:
        model, cfg = load_model(path)
        dtype = dtype or str(model.layers[0].mlp.down_proj.weight.dtype).replace("mlx.core.", "")
        rows += measure(model, name, dtype, sizes, a.trials, a.tokens, a.max_prompt, a.seed)
    tag = a.tag or ("cpu-fixtures" if not a.model else "run")
    out = Path(a.out) if a.out else report_dir("batch_invariance", tag)
    out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    write(rows, out, f"Machine: {machine()}. Command: `python experiments/batch_invariance.py "
                     f"{cmd}` ({time.time() - t0:.0f} s). Sliding window of the Gemma fixtures: "
                     f"16 tokens; prefill chunk 32. Deterministic mode: "
                     f"{'on' if a.deterministic else 'off'}.")
    print(out / "batch_invariance.md")


if __name__ == "__main__":
    main()
