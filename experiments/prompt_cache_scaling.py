"""Prompt-cache lookup cost against the number of entries held.

One cache per N is filled with N real entries (N = 10, 250, 1000, 2000 by default):
each a request of a shared `--prefix`-token system prompt plus its own
`--suffix`-token message, run through `engine.generate(max_tokens=1)` as the server
would, so every entry holds the model's real KV. Then `--trials` rounds each probe every
cache once (a new message after the same prefix; the order rotates, so load on the
machine hits every N alike), median reported:

- `request_cpu_ms` and `request_ms`: one whole 1-token request (lookup, copy of the hit,
  prefill of the new message, sampling, store of the new entry), in this process's CPU
  time (what the request costs; steady on a shared machine) and in wall time;
- `fetch_ms` and `fetch_ops`: the lookup alone (`PromptCache.fetch`) and its index steps
  (the deterministic cost proxy the tests bound);
- `linear_ms`: the lookup the cache did up to 0.2.10, for reference: the prompt compared
  with every entry's tokens in Python, same rules, over the same entries.

`request_vs_10` = request_cpu_ms / request_cpu_ms at the smallest N (the target: within
1.10).

    python experiments/prompt_cache_scaling.py                 # qwen3 CPU fixture
    python experiments/prompt_cache_scaling.py --model DIR --tag h100-1b

Writes prompt_cache_scaling.csv and .md to reports/prompt_cache/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from engine.kv.prompt_cache import PromptCache  # noqa: E402
from experiments._common import machine, md_table, report_dir, write_csv  # noqa: E402

FIELDS = ["entries", "request_cpu_ms", "request_vs_10", "request_ms", "fetch_ms", "fetch_ops",
          "linear_ms", "cached_tokens", "cache_mb"]


def linear_lookup(entries: list, prompt: list) -> int:
    """0.2.10's scan: the longest common prefix over every entry, token by token."""
    best = 0
    for tokens in entries:
        n, m = 0, min(len(tokens), len(prompt))
        while n < m and tokens[n] == prompt[n]:
            n += 1
        best = max(best, min(n, len(prompt) - 1))
    return best


def run(model_dir, sizes, prefix_len, suffix_len, trials):
    model, tok = engine.load(model_dir)
    vocab = min(getattr(getattr(model, "args", None), "vocab_size", 1000), 1000)
    rng = np.random.default_rng(0)
    prefix = rng.integers(32, vocab - 1, size=prefix_len).tolist()
    msg = lambda: rng.integers(32, vocab - 1, size=suffix_len).tolist()
    caches = {n: PromptCache(1 << 40) for n in sizes}
    held = {n: [] for n in sizes}     # the token sequences stored (for the linear reference)

    def request(n, prompt):
        t0, c0 = time.perf_counter(), time.process_time()
        r = engine.generate(model, tok, prompt, max_tokens=1, prompt_cache=caches[n],
                            temperature=0.0)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        held[n].append(prompt)
        return dt, cpu, r.cached_tokens

    for n in sizes:
        while len(caches[n]) < n:
            request(n, prefix + msg())
    m = {n: {"req": [], "cpu": [], "fetch": [], "ops": [], "lin": [], "cached": 0} for n in sizes}
    for t in range(trials):     # one probe per size in turn (rotated): drift hits all alike
        order = sizes[t % len(sizes):] + sizes[:t % len(sizes)]
        for n in order:
            probe, pc, r = prefix + msg(), caches[n], m[n]
            t0 = time.perf_counter()
            linear_lookup(held[n], probe)
            r["lin"].append(time.perf_counter() - t0)
            before = pc.ops
            t0 = time.perf_counter()
            pc.fetch("base", probe)
            r["fetch"].append(time.perf_counter() - t0)
            r["ops"].append(pc.ops - before)
            dt, cpu, r["cached"] = request(n, probe)
            r["req"].append(dt)
            r["cpu"].append(cpu)
    rows = []
    for n in sizes:
        r, med = m[n], lambda xs: 1e3 * statistics.median(xs)
        row = {"entries": n, "request_ms": med(r["req"]), "request_cpu_ms": med(r["cpu"]),
               "fetch_ms": med(r["fetch"]),
               "fetch_ops": max(r["ops"]), "linear_ms": med(r["lin"]),
               "cached_tokens": r["cached"], "cache_mb": caches[n].bytes / 1e6}
        first = rows[0] if rows else row
        row["request_vs_10"] = row["request_cpu_ms"] / first["request_cpu_ms"]
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: the qwen3 bfloat16 CPU fixture)")
    ap.add_argument("--entries", default="10,250,1000,2000")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--trials", type=int, default=21)
    ap.add_argument("--tag", default=None)
    a = ap.parse_args(argv)
    tag = a.tag or ("cpu-fixtures" if a.model is None else "run")
    if a.model is None:
        from parity.fixtures.models import ensure_fixture
        a.model = ensure_fixture("qwen3", "bfloat16")
    sizes = sorted(int(x) for x in a.entries.split(","))
    rows = run(a.model, sizes, a.prefix, a.suffix, a.trials)
    out = report_dir("prompt_cache", tag)
    write_csv(out / "prompt_cache_scaling.csv", rows, FIELDS)
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    table = md_table(["entries", "1-token request CPU ms", "vs 10 entries", "wall ms",
                      "lookup ms", "lookup steps", "0.2.10 linear scan ms", "cached tokens",
                      "cache MB"],
                     [[r["entries"], f"{r['request_cpu_ms']:.2f}", f"{r['request_vs_10']:.3f}",
                       f"{r['request_ms']:.2f}",
                       f"{r['fetch_ms']:.3f}", r["fetch_ops"], f"{r['linear_ms']:.1f}",
                       r["cached_tokens"], f"{r['cache_mb']:.0f}"] for r in rows])
    (out / "prompt_cache_scaling.md").write_text(
        f"# Prompt cache lookup vs entries held - mlx-parity {engine.__version__}\n\n"
        f"Model: `{Path(a.model).name}`; {a.prefix}-token shared prefix + {a.suffix}-token "
        f"message per entry; medians of {a.trials} probes. Machine: {machine()}. "
        f"Command: `python experiments/prompt_cache_scaling.py {cmd}`\n\n{table}\n")
    print(out / "prompt_cache_scaling.md")


if __name__ == "__main__":
    main()
