"""Merged projections (`l1+merged_proj`) and the batch fast step (`l3`) on this
device: exact with mlx-lm, and faster?

For each lever spec (default `l1` and `l1+merged_proj`; any spec of
`engine.levers.parse_spec`, e.g. `l3`: L3 with the batch rows on the fast step),
through `engine.Engine`:

1. exactness against mlx-lm (`mx.array_equal`, diffs printed, no tolerance):
   - `solo` (B=1): the prompt's logits at every position (one forward with a fresh
     cache, as the prompt is processed) against mlx-lm's model, then every decode step's
     logprob vector of `Engine(max_batch=1)` against mlx-lm's `generate_step`;
   - `batch` (each B of `--batches`): `Engine(max_batch=B)` with B prompts submitted at
     once against mlx-lm's `BatchGenerator` at the same B; step 0 of each row comes from
     the batched prompt processing, the rest are decode steps.
2. decode speed in the batch lane: B prompts at once, `--gen` tokens each, decode tok/s
   over the second half of the steps (every row decoding), for each spec and for
   `BatchGenerator`, engines alternating per trial, median of `--trials`.

Prints one JSON line per case and writes them to `--out` (JSON lines) if given. Rows
never stop at EOS (the Engine gets a tokenizer without EOS ids, as BatchGenerator has
none), so every row runs its full length in both engines.

    python -m experiments.presets 1b /tmp/m/1b
    python experiments/merged_exactness.py --model /tmp/m/1b               # GPU, ~2 min
    python experiments/merged_exactness.py --quick                        # CPU dry run
    python experiments/merged_exactness.py --model /tmp/m/1b --specs l1,l1+merged_proj,l3
    python experiments/merged_exactness.py --quick --specs l1,l3   # CPU, ~25 s
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
from engine.levers import LeverError, parse_spec  # noqa: E402


class NoEosTokenizer:
    """The model's tokenizer with no EOS ids: rows run exactly max_tokens."""
    eos_token_ids = ()

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _emit(rec: dict, sink) -> None:
    line = json.dumps({k: (round(v, 4) if isinstance(v, float) and k.endswith("tok_s") else v)
                       for k, v in rec.items()})
    print(line, flush=True)
    if sink is not None:
        sink.write(line + "\n")
        sink.flush()


def _diff(a, b) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())


def _rows_agreement(ours: list, ref: list) -> dict:
    """ours/ref: per row (tokens, logprob vectors). Counts over every row and step."""
    steps = equal = 0
    same_tokens = True
    worst = 0.0
    for (ta, la), (tb, lb) in zip(ours, ref):
        same_tokens &= ta == tb
        for x, y in zip(la, lb):
            steps += 1
            if x.dtype == y.dtype and mx.array_equal(x, y).item():
                equal += 1
            else:
                worst = max(worst, _diff(x, y))
    return {"steps": steps, "equal_steps": equal, "same_tokens": bool(same_tokens),
            "max_abs_logprob_diff": worst}


def _engine_rows(model, tok, levers, prompts, gen, max_batch):
    """Run prompts through an Engine; per prompt (tokens, logprob vectors)."""
    eng = engine.Engine(model, tok, max_batch=max_batch, levers=levers, keep_logprob_arrays=True)
    rids = [eng.submit(p, engine.SamplingParams(max_tokens=gen, temperature=0.0))
            for p in prompts]
    toks = {r: [] for r in rids}
    lps = {r: [] for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            if out.error is not None:
                raise out.error
            toks[out.request_id] += out.token_ids
            lps[out.request_id] += out.logprob_arrays
    return [(toks[r], lps[r]) for r in rids]


def _ref_batch_rows(ref_model, prompts, gen, B):
    from parity.batch import Insert, run_mlx_lm
    rows = run_mlx_lm(ref_model, [Insert(0, p, gen) for p in prompts],
                      completion_batch_size=B, prefill_batch_size=min(B, 8))
    return [(r.tokens, r.logprobs) for r in rows]


def exactness(spec, model, tok, ref_model, prompts, steps, batches, sink):
    from mlx_lm.generate import generate_step as ref_step
    from mlx_lm.models.cache import make_prompt_cache

    lv = parse_spec(spec)
    dev = str(mx.default_device())
    # solo: the prompt's logits at every position, then the decode steps
    x = mx.array([prompts[0]])
    mine = model(x, cache=model.make_cache())
    theirs = ref_model(x, cache=make_prompt_cache(ref_model))
    rec = {"case": "solo", "spec": spec, "device": dev, "B": 1, "prompt": len(prompts[0]),
           "prompt_logits_equal": bool(mx.array_equal(mine, theirs).item()),
           "prompt_logits_max_abs_diff": _diff(mine, theirs)}
    ours = _engine_rows(model, tok, lv, prompts[:1], steps, max_batch=1)
    ref = [([int(t) for t, _ in s], [lp for _, lp in s]) for s in
           [list(ref_step(x[0], ref_model, max_tokens=steps))]]
    rec.update(_rows_agreement(ours, ref))
    _emit(rec, sink)
    for B in batches:
        ps = prompts[:B]
        ours = _engine_rows(model, tok, lv, ps, steps, max_batch=B)
        ref = _ref_batch_rows(ref_model, ps, steps, B)
        rec = {"case": "batch", "spec": spec, "device": dev, "B": B, "prompt": len(ps[0])}
        rec.update(_rows_agreement(ours, ref))
        # step 0 of every row: the batched prompt processing's output
        rec["first_step_equal_rows"] = sum(bool(mx.array_equal(a[1][0], b[1][0]).item())
                                           for a, b in zip(ours, ref))
        _emit(rec, sink)


def _window_tok_s(step_times: list, B: int) -> float:
    """Decode tok/s over the second half of the steps (all rows decoding; the last step
    left out: it frees rows)."""
    half = max(1, (len(step_times) - 1) // 2)
    window = step_times[-1 - half:-1] or step_times[-1:]
    return B * len(window) / sum(window)


def _time_engine(model, tok, lv, prompts, gen):
    eng = engine.Engine(model, tok, max_batch=len(prompts), levers=lv)
    for p in prompts:
        eng.submit(p, engine.SamplingParams(max_tokens=gen, temperature=0.0))
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    mx.synchronize()
    return _window_tok_s(times, len(prompts))


def _time_ref(ref_model, prompts, gen):
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    B = len(prompts)
    g = BatchGenerator(ref_model, completion_batch_size=B, prefill_batch_size=min(B, 8))
    try:
        sampler = make_sampler(temp=0.0)
        g.insert([list(p) for p in prompts], max_tokens=[gen] * B, samplers=[sampler] * B)
        times = []
        while len(g._unprocessed_sequences) + len(g._prompt_batch) + len(g._generation_batch):
            t = time.perf_counter()
            g.next()
            times.append(time.perf_counter() - t)
        mx.synchronize()
        return _window_tok_s(times, B)
    finally:
        g.close()


def speed(specs, models, tok, ref_model, prompts, batches, gen, trials, sink):
    for B in batches:
        ps = prompts[:B]
        runs = {"mlx_lm": lambda p=ps: _time_ref(ref_model, p, gen)}
        for spec in specs:
            runs[spec] = (lambda p=ps, s=spec: _time_engine(models[s], tok, parse_spec(s), p, gen))
        for fn in runs.values():                       # warm-up at these shapes
            fn()
        res = {k: [] for k in runs}
        order = list(runs)
        for t in range(trials):
            for k in (order if t % 2 == 0 else order[::-1]):
                gc.collect()
                mx.synchronize()
                res[k].append(runs[k]())
        med = {k: statistics.median(v) for k, v in res.items()}
        for spec in specs:
            _emit({"case": "speed", "spec": spec, "device": str(mx.default_device()), "B": B,
                   "prompt": len(ps[0]), "gen": gen, "trials": trials,
                   "ours_decode_tok_s": med[spec], "mlx_lm_decode_tok_s": med["mlx_lm"],
                   "ratio": round(med[spec] / med["mlx_lm"], 4),
                   "vs_l1": round(med[spec] / med["l1"], 4) if "l1" in med else None}, sink)


def report(jsonl: str, out: Path, note: str = "") -> None:
    """Tables (pandas) and a plot (matplotlib) from a run's JSON lines, into `out`."""
    import matplotlib
    import pandas as pd
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(jsonl) if line.startswith("{")]
    df = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "merged_exactness.csv", index=False)

    def table(d, cols):
        d = d[[c for c in cols if c in d.columns]]
        lines = ["| " + " | ".join(d.columns) + " |", "|" + "---|" * len(d.columns)]
        def cell(v):
            if isinstance(v, float) and v == v and v.is_integer():
                return str(int(v))
            return f"{v:.3f}" if isinstance(v, float) else str(v)
        lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in d.itertuples(index=False)]
        return lines
    lines = [f"# Merged projections and the batch fast step — mlx-parity {engine.__version__}", "", note, "",
             "## Exactness against mlx-lm", ""]
    lines += table(df[df["case"].isin(["solo", "batch"])],
                   ["case", "spec", "B", "steps", "equal_steps", "same_tokens", "max_abs_logprob_diff"])
    sp = df[df["case"] == "speed"]
    if len(sp):
        lines += ["", "## Decode speed (tokens/s over all rows)", ""]
        lines += table(sp, ["spec", "B", "ours_decode_tok_s", "mlx_lm_decode_tok_s", "ratio", "vs_l1"])
        piv = sp.pivot(index="B", columns="spec", values="ratio")
        ax = piv.plot.bar(rot=0, figsize=(6, 4))
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("decode tok/s, ours / mlx-lm BatchGenerator")
        ax.figure.tight_layout()
        ax.figure.savefig(out / "merged_exactness.png", dpi=110)
        plt.close(ax.figure)
    (out / "merged_exactness.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (e.g. experiments/presets.py 1b)")
    ap.add_argument("--quick", action="store_true", help="CPU dry run on the llama bf16 fixture")
    ap.add_argument("--specs", default="l1,l1+merged_proj")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=8, help="generated tokens per exactness case")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per speed run")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--out", help="also write the JSON lines to this file")
    ap.add_argument("--report", help="with --from-jsonl (or --out): write tables and a plot here")
    ap.add_argument("--from-jsonl", help="build the report from this file of an earlier run, run nothing")
    ap.add_argument("--note", default="", help="a paragraph for the report (the command, the machine)")
    a = ap.parse_args(argv)
    if a.from_jsonl:
        if not a.report:
            raise SystemExit("merged_exactness: --from-jsonl needs --report DIR")
        report(a.from_jsonl, Path(a.report), a.note)
        return 0
    try:
        specs = a.specs.split(",")
        for s in specs:
            parse_spec(s)
    except LeverError as e:
        raise SystemExit(f"merged_exactness: {e}") from None
    if a.quick or not a.model:
        from parity.fixtures.models import ensure_fixture
        a.model = str(ensure_fixture("llama", "bfloat16"))
    batches = [int(b) for b in a.batches.split(",")]
    from parity.oracles import mlx_lm_oracle as oracle

    ref_model = oracle.load_model(a.model)
    models, tok = {}, None
    for s in specs:
        models[s], t = engine.load(a.model)
        tok = tok or NoEosTokenizer(t)
    vocab = models[specs[0]].args.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(32, min(vocab, 1000) - 1, size=a.prompt).tolist()
               for _ in range(max(batches + [1]))]
    sink = open(a.out, "w") if a.out else None
    t0 = time.perf_counter()
    for s in specs:
        exactness(s, models[s], tok, ref_model, prompts, a.steps, batches, sink)
    if not a.no_speed:
        speed(specs, models, tok, ref_model, prompts, batches, a.gen, a.trials, sink)
    print(f"# done in {time.perf_counter() - t0:.0f}s", flush=True)
    if sink is not None:
        sink.close()
        if a.report:
            report(a.out, Path(a.report), a.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
