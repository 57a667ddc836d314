"""Warm vs cold prompt cache: time to the first token with and without a cached prefix.

A request = a shared prefix of `P` tokens + a fresh suffix of `--suffix` tokens.
Per model and prefix length, four timings (best of `--trials`, engines
alternating so noise hits both):

- ours cold: `engine.generate(max_tokens=1)` with an empty `PromptCache`
  (the store of the finished prompt is included, as in the server);
- ours warm: the same call after one call on the prefix filled the cache
  (fetch = longest prefix + deep copy, then only the suffix is prefilled);
- mlx-lm cold: `generate_step` over the whole prompt with a fresh cache;
- mlx-lm warm: `copy.deepcopy` of a cache holding the prefix (what
  `mlx_lm.server`'s prompt cache does on a hit), then `generate_step` over
  the suffix.

Ratios: warm speedup = cold / warm per engine; ours / mlx-lm for the warm
TTFT (<1 = we are faster). Also recorded: `cached_tokens`, and whether the
first-token logprobs of warm and cold are bit-equal (they need not be: the
suffix-only prefill multiplies matrices of a different shape; the L1 claim is
warm-ours == warm-mlx-lm, tested in tests/parity/test_generate.py).

    python experiments/prompt_cache_warm.py --quick                  # CPU fixtures
    python experiments/prompt_cache_warm.py --model DIR --tag h200-1b --prefix 2048,8192

Writes CSV + markdown to reports/prompt_cache/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from engine.kv.prompt_cache import PromptCache  # noqa: E402
from experiments._common import machine, report_dir, write_csv  # noqa: E402


def _settle():
    mx.synchronize()
    gc.collect()
    mx.clear_cache()


def _ours(model, tok, prefix, suffix, warm):
    pc = PromptCache(max_bytes=8 << 30)
    if warm:
        engine.generate(model, tok, prefix, max_tokens=1, prompt_cache=pc, temperature=0.0)
    _settle()
    t0 = time.perf_counter()
    r = engine.generate(model, tok, prefix + suffix, max_tokens=1, prompt_cache=pc,
                        temperature=0.0, logprobs=True)
    dt = time.perf_counter() - t0
    return dt, r.cached_tokens, r.logprobs[0]["logprob"]


def _mlxlm(model, prefix, suffix, warm):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    if warm:
        held = make_prompt_cache(model)
        # max_tokens=0 prefills the whole prefix and stops before feeding anything back
        # (with max_tokens=1 its pipelining would already have fed the first token)
        for _ in generate_step(mx.array(prefix), model, max_tokens=0, prompt_cache=held):
            pass
        assert held[0].offset == len(prefix), held[0].offset
    _settle()
    t0 = time.perf_counter()
    if warm:
        cache, feed = copy.deepcopy(held), suffix
    else:
        cache, feed = make_prompt_cache(model), prefix + suffix
    tok, lp = next(generate_step(mx.array(feed), model, max_tokens=1, prompt_cache=cache))
    first_lp = float(lp[tok].item())
    return time.perf_counter() - t0, first_lp


def bench(model_dir, prefixes, suffix_len, trials):
    from mlx_lm.utils import load as load_ref

    model, tok = engine.load(model_dir)
    ref, _ = load_ref(str(model_dir))
    vocab = model.args.vocab_size if hasattr(model, "args") else 1000
    rng = np.random.default_rng(0)
    rows = []
    for P in prefixes:
        prefix = rng.integers(32, min(vocab, 1000) - 1, size=P).tolist()
        suffix = rng.integers(32, min(vocab, 1000) - 1, size=suffix_len).tolist()
        _ours(model, tok, prefix[:32], suffix[:4], True)   # warm-up (kernel compilation)
        _mlxlm(ref, prefix[:32], suffix[:4], True)
        best = {}
        extra = {}
        for t in range(trials):
            jobs = [("ours", w) for w in (False, True)] + [("mlx_lm", w) for w in (False, True)]
            if t % 2:
                jobs.reverse()
            for eng, w in jobs:
                if eng == "ours":
                    dt, cached, lp = _ours(model, tok, prefix, suffix, w)
                    extra[("ours", w)] = (cached, lp)
                else:
                    dt, lp = _mlxlm(ref, prefix, suffix, w)
                    extra[("mlx_lm", w)] = (None, lp)
                key = (eng, w)
                best[key] = min(best.get(key, float("inf")), dt)
        row = {"model": Path(model_dir).name, "prefix": P, "suffix": suffix_len,
               "ours_cold_ms": 1e3 * best[("ours", False)], "ours_warm_ms": 1e3 * best[("ours", True)],
               "mlxlm_cold_ms": 1e3 * best[("mlx_lm", False)],
               "mlxlm_warm_ms": 1e3 * best[("mlx_lm", True)],
               "cached_tokens": extra[("ours", True)][0]}
        row["ours_speedup"] = row["ours_cold_ms"] / row["ours_warm_ms"]
        row["mlxlm_speedup"] = row["mlxlm_cold_ms"] / row["mlxlm_warm_ms"]
        row["warm_ratio"] = row["ours_warm_ms"] / row["mlxlm_warm_ms"]
        row["cold_ratio"] = row["ours_cold_ms"] / row["mlxlm_cold_ms"]
        row["warm_eq_mlxlm_warm"] = extra[("ours", True)][1] == extra[("mlx_lm", True)][1]
        row["warm_eq_cold"] = extra[("ours", True)][1] == extra[("ours", False)][1]
        row["warm_cold_dlogprob"] = abs(extra[("ours", True)][1] - extra[("ours", False)][1])
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
        rows.append(row)
    return rows


FIELDS = ["model", "prefix", "suffix", "cached_tokens", "ours_cold_ms", "ours_warm_ms",
          "mlxlm_cold_ms", "mlxlm_warm_ms", "ours_speedup", "mlxlm_speedup", "warm_ratio",
          "cold_ratio", "warm_eq_mlxlm_warm", "warm_eq_cold", "warm_cold_dlogprob"]


def write(rows, out: Path, note: str):
    write_csv(out / "prompt_cache_warm.csv", rows, FIELDS)
    lines = [f"# Prompt cache: warm vs cold — mlx-parity {engine.__version__}", "", note, "",
             "Time of a 1-token call (ms, best of trials). speedup = cold / warm; "
             "ratio = ours / mlx-lm (<1 = ours faster).", "",
             "| model | prefix+suffix | cached | ours cold → warm (speedup) | mlx-lm cold → warm (speedup) "
             "| warm ratio | cold ratio | first logprob warm == mlx-lm warm | warm == cold (|Δ|) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prefix']}+{r['suffix']} | {r['cached_tokens']} | "
            f"{r['ours_cold_ms']:.1f} → {r['ours_warm_ms']:.1f} ({r['ours_speedup']:.2f}×) | "
            f"{r['mlxlm_cold_ms']:.1f} → {r['mlxlm_warm_ms']:.1f} ({r['mlxlm_speedup']:.2f}×) | "
            f"{r['warm_ratio']:.3f} | {r['cold_ratio']:.3f} | {r['warm_eq_mlxlm_warm']} | "
            f"{r['warm_eq_cold']} ({r['warm_cold_dlogprob']:.2e}) |")
    (out / "prompt_cache_warm.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model dir (repeatable)")
    ap.add_argument("--quick", action="store_true", help="CPU fixtures (bfloat16) + the speed preset")
    ap.add_argument("--prefix", default="256,1024")
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    prefixes = [int(x) for x in a.prefix.split(",")]
    models = [Path(m) for m in (a.model or [])]
    if a.quick or not models:
        from parity.fixtures.models import ensure_fixture
        from experiments.presets import build_preset
        import tempfile
        models += [ensure_fixture(f, "bfloat16") for f in ("llama", "qwen3", "gemma4_text")]
        models.append(build_preset("speed", Path(tempfile.gettempdir()) / "mlxp-preset-speed"))
    rows = []
    for m in models:
        rows += bench(m, prefixes, a.suffix, a.trials)
    tag = a.tag or ("cpu-fixtures" if a.quick or not a.model else "run")
    out = Path(a.out) if a.out else report_dir("prompt_cache", tag)
    out.mkdir(parents=True, exist_ok=True)
    write(rows, out, f"Machine: {machine()}. Command: `python experiments/prompt_cache_warm.py "
                     f"{' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(out / "prompt_cache_warm.md")


if __name__ == "__main__":
    main()
