"""Decode benchmark: our token loop per tier vs mlx-lm's `generate_step`, same process, same model.

For each model, prompt length and tier: prefill tok/s (prompt / time to the first
token) and decode tok/s (over `--gen` tokens after the first), for ours and for
mlx-lm measured in the same trials. Engines alternate order within each trial;
the median of `--trials` is reported, and ratios are ours / mlx-lm (>1 = faster).

A tier is `l1`, `l2`, `l3`, or a tier with levers switched: `l3-compiled_decode`
(l3 without the compiled step), `l1+merged_proj` (l1 with merged projections).
Each tier also gets a count of the work one decode step issues: the operations of
its evaluated graph that launch a kernel (views such as reshape/transpose/slice are
not counted; on the CPU the fused ops appear decomposed, so count on the GPU), and
the host time to build one step (calling the model / the compiled step, no eval).

    python experiments/bench_decode.py --quick --tier l1,l3                 # CPU fixtures
    python experiments/bench_decode.py --model DIR --tier l1,l3 --tag h200-1b

Writes bench_decode.csv (model,prompt,tier,ours_tok_s,mlx_lm_tok_s,ratio, ...),
bench_decode.md and bench_decode.png to reports/bench_decode/<version>/<tag>/. `vs_l1` is a
tier's decode tok/s over our plain L1 loop's in the same trials (when l1 is among the tiers).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import re
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from engine.fast.apply import decoder_for  # noqa: E402
from engine.levers import LeverError, Levers, parse_spec  # noqa: E402
from experiments._common import mega_env  # noqa: E402
from engine.loader import load_model as load_ours  # noqa: E402
from engine.step.stepper import generate_step as ours_step  # noqa: E402

VIEWS = {"Broadcast", "Transpose", "Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze",
         "Slice", "Split", "AsStrided", "StopGradient", "Depends"}
FIELDS = ["model", "prompt", "tier", "ours_tok_s", "mlx_lm_tok_s", "ratio", "vs_l1",
          "ours_prefill_tok_s", "mlx_lm_prefill_tok_s", "prefill_ratio",
          "ours_kernels_per_step", "mlx_lm_kernels_per_step", "ours_host_ms_per_step",
          "mlx_lm_host_ms_per_step", "ours_best_tok_s", "mlx_lm_best_tok_s", "best_ratio",
          "gen", "trials", "levers", "one_kernel", "error"]



def parse_tier(spec: str) -> Levers:
    try:
        return parse_spec(spec)
    except LeverError as e:
        raise SystemExit(f"bench_decode: {e}") from None


def _time_run(step_fn, model, prompt, gen):
    mx.synchronize()
    gc.collect()
    mx.clear_cache()
    t0 = time.perf_counter()
    it = step_fn(mx.array(prompt), model, max_tokens=gen + 1)
    next(it)
    t1 = time.perf_counter()
    n = sum(1 for _ in it)
    mx.synchronize()
    t2 = time.perf_counter()
    return {"prefill": len(prompt) / (t1 - t0), "decode": n / (t2 - t1) if n else 0.0}


def step_work(call, caches_of, model, prompt_len: int, reps: int = 20) -> tuple[int, float]:
    """(kernel-launching ops in one decode step's graph, host ms to build one step)."""
    caches = caches_of(model, prompt_len)
    tok = mx.array([3])
    mx.eval(call(model, tok, caches))                        # warm (trace, compile)
    f = io.StringIO()
    out = call(model, tok, caches)
    try:
        mx.export_to_dot(f, out)
        ops = re.findall(r'label\s*=\s*"([A-Za-z_0-9]+)"', f.getvalue())
        n_ops = sum(1 for o in ops if o not in VIEWS)
    except Exception as e:                                   # counted as unknown, said so
        print(f"# export_to_dot failed: {e}", flush=True)
        n_ops = -1
    mx.eval(out)
    times = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        out = call(model, tok, caches)
        times.append(time.perf_counter() - t0)
        mx.eval(out)
    return n_ops, 1e3 * statistics.median(times)


def _prefilled(make_cache):
    def caches_of(model, n):
        c = make_cache(model)
        model(mx.array([list(range(1, n))]), cache=c)
        mx.eval([x.state for x in c])
        return c
    return caches_of


def bench(model_dir, tiers: list[str], lengths, gen, trials):
    from mlx_lm.generate import generate_step as ref_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as load_ref

    ref = load_ref(Path(model_dir))[0]
    plain = load_ours(model_dir)[0]
    merged = None
    engines = {}
    for spec in tiers:
        lv = parse_tier(spec)
        if lv.merged_proj:
            merged = merged or load_ours(model_dir)[0]
        m = merged if lv.merged_proj else plain
        dec = decoder_for(m, lv)
        if lv.merged_proj and dec is None:
            from engine.fast.merge import merge_projections
            merge_projections(m)

        def run(p, model, max_tokens, _dec=dec):
            return ours_step(p, model, max_tokens=max_tokens, decoder=_dec)
        engines[spec] = (lv, m, dec, run)
    rng = np.random.default_rng(0)
    vocab = plain.args.vocab_size
    name = Path(model_dir).name
    rows = []
    for L in lengths:
        prompt = rng.integers(32, min(vocab, 1000) - 1, size=L).tolist()
        work = {}

        def ref_call(model, tok, caches):
            return model(tok[None], cache=caches)[:, -1, :]
        work["mlx_lm"] = step_work(ref_call, _prefilled(make_prompt_cache), ref, L)
        runs = {"mlx_lm": (ref_step, ref)}
        errors = {}
        for spec, (lv, m, dec, run) in engines.items():
            try:
                if dec is not None:
                    def call(model, tok, caches, _dec=dec):
                        return _dec(tok, caches)

                    def caches_of(model, n, _dec=dec):
                        c = _prefilled(lambda mm: mm.make_cache())(model, n)
                        _dec.reserve(c, 64)
                        return c
                else:
                    call, caches_of = ref_call, _prefilled(lambda mm: mm.make_cache())
                work[spec] = step_work(call, caches_of, m, L)
                _time_run(run, m, prompt, gen)                  # warm-up at the timed shapes
                runs[spec] = (run, m)
            except Exception as e:                              # recorded, not hidden
                errors[spec] = f"{type(e).__name__}: {e}"[:300]
                print(f"# {name} {L} {spec}: {errors[spec]}", flush=True)
        _time_run(ref_step, ref, prompt, gen)
        res = {k: [] for k in runs}
        order = list(runs)
        for t in range(trials):
            for k in (order if t % 2 == 0 else order[::-1]):
                fn, m = runs[k]
                res[k].append(_time_run(fn, m, prompt, gen))
        med = {k: {q: statistics.median(r[q] for r in v) for q in ("prefill", "decode")}
               for k, v in res.items()}
        ref_med = med["mlx_lm"]
        # the fastest trial of each (the machine's spread between trials can be large)
        best = {k: max(r["decode"] for r in v) for k, v in res.items()}
        for spec in engines:
            o = med.get(spec)
            row = {"model": name, "prompt": L, "tier": spec, "gen": gen, "trials": trials,
                   "mlx_lm_tok_s": ref_med["decode"], "mlx_lm_prefill_tok_s": ref_med["prefill"],
                   "mlx_lm_kernels_per_step": work["mlx_lm"][0],
                   "mlx_lm_host_ms_per_step": work["mlx_lm"][1],
                   "mlx_lm_best_tok_s": best["mlx_lm"],
                   "levers": json.dumps(engines[spec][0].as_dict()),
                   # (whether the step ran as the one kernel, engine.fast.mega)
                   "one_kernel": bool(engines[spec][2] is not None and engines[spec][2].stats.mega),
                   "error": errors.get(spec, "")}
            if o is not None:
                row.update(ours_tok_s=o["decode"], ratio=o["decode"] / ref_med["decode"],
                           ours_prefill_tok_s=o["prefill"],
                           prefill_ratio=o["prefill"] / ref_med["prefill"],
                           ours_kernels_per_step=work[spec][0], ours_host_ms_per_step=work[spec][1],
                           ours_best_tok_s=best[spec], best_ratio=best[spec] / best["mlx_lm"])
            rows.append(row)
        # each tier against our own plain L1 loop in the same trials (the lever's own effect)
        l1 = next((r for r in rows[-len(engines):] if r["tier"] == "l1" and "ours_tok_s" in r), None)
        for row in rows[-len(engines):]:
            if l1 is not None and "ours_tok_s" in row:
                row["vs_l1"] = row["ours_tok_s"] / l1["ours_tok_s"]
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                              for k, v in row.items() if k != "levers"}), flush=True)
    return rows


def write(rows, out: Path, note: str):
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows, columns=FIELDS)
    df.to_csv(out / "bench_decode.csv", index=False)
    show = df[["model", "prompt", "tier", "ours_tok_s", "mlx_lm_tok_s", "ratio", "best_ratio", "vs_l1", "prefill_ratio",
               "ours_kernels_per_step", "mlx_lm_kernels_per_step", "ours_host_ms_per_step",
               "mlx_lm_host_ms_per_step", "error"]].copy()
    for c in ("ours_tok_s", "mlx_lm_tok_s"):
        show[c] = show[c].map(lambda x: f"{x:.1f}")
    for c in ("ratio", "best_ratio", "vs_l1", "prefill_ratio", "ours_host_ms_per_step", "mlx_lm_host_ms_per_step"):
        show[c] = show[c].map(lambda x: f"{x:.3f}")
    lines = [f"# Decode benchmark — mlx-parity {engine.__version__}", "", note, "",
             "| " + " | ".join(show.columns) + " |", "|" + "---|" * len(show.columns)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in show.itertuples(index=False)]
    (out / "bench_decode.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = df[df["error"].fillna("") == ""]
    models = sorted(ok["model"].unique())
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        piv = ok[ok["model"] == model].pivot(index="prompt", columns="tier", values="ratio")
        piv.plot.bar(ax=ax, rot=0)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(model, fontsize=9)
        ax.set_ylabel("decode tok/s, ours / mlx-lm")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_decode.png", dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model dir (repeatable)")
    ap.add_argument("--quick", action="store_true", help="CPU fixtures")
    ap.add_argument("--tier", default="l1,l3", help="comma-separated tiers, e.g. l1,l3,l3-compiled_decode")
    ap.add_argument("--lengths", default="128,2048")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    tiers = a.tier.split(",")
    for t in tiers:
        parse_tier(t)
    models = a.model or []
    if a.quick or not models:
        from parity.fixtures.models import ensure_fixture
        models += [str(ensure_fixture(f, "bfloat16")) for f in ("llama", "qwen3")]
    rows = []
    for m in models:
        rows += bench(m, tiers, lengths, a.gen, a.trials)
    tag = a.tag or ("cpu-fixtures" if a.quick or not a.model else "custom")
    out = Path(a.out) if a.out else REPO / "reports" / "bench_decode" / engine.__version__ / tag
    cmd = "python experiments/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = " ".join(f"{k}={v}" for k, v in mega_env().items())
    write(rows, out, f"Device {mx.default_device()}, mlx {mx.__version__}. Median of {a.trials} "
                     f"trials, {a.gen} decode tokens; ratio = ours / mlx-lm decode tok/s in the same "
                     f"trials; best_ratio = the fastest trial of each. One-kernel step settings: {env or 'the defaults'}. "
                     f"Reproduce: `{(env + ' ' if env else '') + cmd.strip()}`")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
