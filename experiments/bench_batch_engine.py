"""In-process batching benchmark: our `BatchScheduler` vs mlx-lm 0.32.2's `BatchGenerator`.

No HTTP: both engines get the same B prompts at once (random tokens, greedy,
no stop tokens, exactly --gen tokens each) on the same weights in the same
process, and every step's tokens and logprobs are pulled the way a server
would (the token to the host, the logprobs row kept). Reported per B:

- decode tok/s: tokens emitted over the steps where all B rows were decoding;
- step ms (median over those steps) and its host share: the time `step()` /
  `next()` spends before it blocks on the device, measured with a model so
  small (``--probe``) that the device work is ~0, so the step time is the
  engine's own per-step cost (Python, graph building, kernel launches);
- whole-run tok/s (prefill included).

Engines alternate per trial (best kept), so background noise hits both alike.

    python experiments/bench_batch_engine.py --quick                 # CPU: llama fixture + probe
    python experiments/bench_batch_engine.py --model DIR --tag h200-1b

Writes CSV + markdown to reports/bench_batch_engine/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from experiments._common import machine, md_table, write_csv  # noqa: E402

FIELDS = ["model", "bias", "B", "prompt", "gen", "ours_decode_tps", "mlxlm_decode_tps", "decode_ratio",
          "ours_step_ms", "mlxlm_step_ms", "ours_run_tps", "mlxlm_run_tps", "run_ratio",
          "tokens_equal"]


def _run_ours(model, prompts, gen, bias=None):
    from engine.step.batch import BatchRequest, BatchScheduler
    from engine.step.sampling import make_logits_processors, make_sampler

    sampler = make_sampler(temp=0.0)
    sched = BatchScheduler(model, eos_token_ids=(), completion_batch_size=max(32, len(prompts)),
                           prefill_batch_size=8, prefill_step_size=2048)
    for p in prompts:
        procs = make_logits_processors(logit_bias=bias) if bias else ()
        sched.submit(BatchRequest(list(p), max_tokens=gen, sampler=sampler,
                                  logits_processors=procs))
    out = {}
    steps = []
    t0 = time.perf_counter()
    while sched.has_work():
        t = time.perf_counter()
        evs = sched.step()
        steps.append((time.perf_counter() - t, len(evs)))
        for ev in evs:
            if ev.token is not None:
                out.setdefault(ev.uid, []).append(ev.token)
    return time.perf_counter() - t0, steps, [out[k] for k in sorted(out)]


def _run_ref(model, prompts, gen, bias=None):
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(temp=0.0)
    g = BatchGenerator(model, completion_batch_size=max(32, len(prompts)), prefill_batch_size=8,
                       prefill_step_size=2048)
    try:
        uids = g.insert([list(p) for p in prompts], max_tokens=[gen] * len(prompts),
                        samplers=[sampler] * len(prompts),
                        logits_processors=[make_logits_processors(logit_bias=bias) if bias
                                           else [] for _ in prompts])
        out = {u: [] for u in uids}
        steps = []
        t0 = time.perf_counter()
        while True:
            busy = len(g._unprocessed_sequences) + len(g._prompt_batch) + len(g._generation_batch)
            if not busy:
                break
            t = time.perf_counter()
            _, resp = g.next()
            steps.append((time.perf_counter() - t, len(resp)))
            for r in resp:
                out[r.uid].append(int(r.token))
        return time.perf_counter() - t0, steps, [out[u] for u in uids]
    finally:
        g.close()


def _summary(wall, steps, B, gen):
    full = [dt for dt, n in steps if n == B]
    # the last step also emits B tokens but frees rows; keep it, it is a real step
    dec = sum(full)
    return {"decode_tps": len(full) * B / dec if dec else float("nan"),
            "step_ms": 1e3 * statistics.median(full) if full else float("nan"),
            "run_tps": B * gen / wall}


def bench(name, ours_m, ref_m, Bs, prompt_len, gen, trials, vocab, bias=None):
    rng = np.random.default_rng(0)
    rows = []
    for B in Bs:
        prompts = [rng.integers(32, min(vocab, 1000) - 1, size=prompt_len).tolist()
                   for _ in range(B)]
        _run_ours(ours_m, prompts, 4, bias)        # warm-up: kernels for this B
        _run_ref(ref_m, prompts, 4, bias)
        best = {}
        toks = {}
        for t in range(trials):
            order = [("ours", _run_ours, ours_m), ("mlx_lm", _run_ref, ref_m)]
            if t % 2:
                order.reverse()
            for who, fn, m in order:
                gc.collect()
                mx.synchronize()
                wall, steps, out = fn(m, prompts, gen, bias)
                s = _summary(wall, steps, B, gen)
                toks[who] = out
                b = best.get(who)
                best[who] = s if b is None else {
                    "decode_tps": max(b["decode_tps"], s["decode_tps"]),
                    "step_ms": min(b["step_ms"], s["step_ms"]),
                    "run_tps": max(b["run_tps"], s["run_tps"])}
        o, r = best["ours"], best["mlx_lm"]
        row = {"model": name, "bias": bool(bias), "B": B, "prompt": prompt_len, "gen": gen,
               "ours_decode_tps": o["decode_tps"], "mlxlm_decode_tps": r["decode_tps"],
               "decode_ratio": o["decode_tps"] / r["decode_tps"],
               "ours_step_ms": o["step_ms"], "mlxlm_step_ms": r["step_ms"],
               "ours_run_tps": o["run_tps"], "mlxlm_run_tps": r["run_tps"],
               "run_ratio": o["run_tps"] / r["run_tps"],
               "tokens_equal": toks["ours"] == toks["mlx_lm"]}
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                          for k, v in row.items()}), flush=True)
        rows.append(row)
    return rows


def _probe_model_dir(dtype):
    """A 2-layer, 64-wide llama: the device work per step is ~0, the rest is engine overhead."""
    from parity.fixtures.models import ensure_fixture
    return ensure_fixture("llama", dtype)


def _load_pair(model_dir):
    from engine.loader import load_model as load_ours
    from mlx_lm.utils import load_model as load_ref
    ours = load_ours(model_dir)[0]
    ref = load_ref(Path(model_dir))[0]
    return ours, ref


def write(rows, out: Path, note: str):
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_batch_engine.csv", rows, FIELDS)
    table = md_table(
        ["model", "logit bias", "B", "ours decode tok/s", "mlx-lm decode tok/s", "ratio", "ours step ms",
         "mlx-lm step ms", "run ratio (with prefill)", "same tokens"],
        [[r["model"], "yes" if r["bias"] else "no", r["B"], f"{r['ours_decode_tps']:.1f}", f"{r['mlxlm_decode_tps']:.1f}",
          f"{r['decode_ratio']:.2f}×", f"{r['ours_step_ms']:.2f}", f"{r['mlxlm_step_ms']:.2f}",
          f"{r['run_ratio']:.2f}×", "yes" if r["tokens_equal"] else "no"] for r in rows])
    (out / "bench_batch_engine.md").write_text(
        "# In-process batching: BatchScheduler vs mlx-lm BatchGenerator\n\n" + note + "\n\n"
        + table + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model dir (repeatable)")
    ap.add_argument("--quick", action="store_true", help="CPU: the llama fixture (the probe)")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--logit-bias", choices=("off", "on", "both"), default="both",
                    help="each row bans the EOS ids with a logit bias (as bench_batching's "
                         "requests do): off, on, or both")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    Bs = [int(x) for x in a.batches.split(",")]
    models = list(a.model or [])
    if a.quick or not models:
        models.insert(0, str(_probe_model_dir("bfloat16")))
    rows = []
    for m in models:
        ours, ref = _load_pair(m)
        from engine.text.tokenizer import load_tokenizer
        eos = {int(t): -100.0 for t in load_tokenizer(m).eos_token_ids}
        for b in {"off": [None], "on": [eos], "both": [None, eos]}[a.logit_bias]:
            rows += bench(Path(m).name, ours, ref, Bs, a.prompt, a.gen, a.trials,
                          ours.args.vocab_size, b)
        del ours, ref
        gc.collect()
    tag = a.tag or ("cpu-fixtures" if not a.model else "custom")
    out = Path(a.out) if a.out else REPO / "reports" / "bench_batch_engine" / engine.__version__ / tag
    cmd = "python experiments/bench_batch_engine.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    write(rows, out, f"Machine: {machine()}. Prompt {a.prompt} tokens, {a.gen} decode tokens per "
                     f"row, greedy, no stop tokens (with logit bias: each row's EOS ids banned by its own logit-bias processor); best of {a.trials} trials, engines alternating. "
                     f"Reproduce: `{cmd.strip()}`")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
