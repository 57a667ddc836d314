"""What an embeddings request costs next to the prefill of the same tokens.

    python experiments/embed_cost.py [--preset speed] [--dtype float32] [--inputs 16] [--trials 3] \
        [--tag cpu-speed]

On a random-weight model of a preset shape (`experiments.presets`): `--inputs` token
sequences of random lengths (16-256, seeded). Timed, each `--trials` times (median):

- `embed_batched`: `engine.embed` of all inputs at once (length-sorted, right-padded groups);
- `embed_one_by_one`: `engine.embed` of each input alone;
- `prefill`: the model's full forward (logits of every position, no cache) of each input
  alone: what prefilling the same tokens as a prompt costs.

Reported: tokens per second of each and the ratios. Writes embed_cost.{json,md} to
reports/embed_cost/<version>/<tag>/ (or --out).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402

from experiments._common import dump_json, machine, md_table, report_dir  # noqa: E402


def _time(fn, trials: int) -> float:
    fn()                                   # warm-up (compilation, allocator)
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="speed")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", help="a model directory instead of a preset")
    ap.add_argument("--inputs", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tag", default="cpu-speed")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import engine
    from experiments.presets import build_preset

    path = Path(a.model) if a.model else Path("/tmp/embed_cost") / f"{a.preset}-{a.dtype}"
    if not a.model and not (path / "config.json").exists():
        build_preset(a.preset, path, dtype=a.dtype)
    model, tok = engine.load(str(path))
    rng = random.Random(0)
    vocab = model.args.vocab_size
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))] for _ in range(a.inputs)]
    tokens = sum(map(len, seqs))

    def batched():
        mx.eval(engine.embed(model, tok, seqs).vectors)

    def one_by_one():
        for s in seqs:
            mx.eval(engine.embed(model, tok, [s]).vectors)

    def prefill():
        for s in seqs:
            mx.eval(model(mx.array([s])))

    times = {"embed_batched": _time(batched, a.trials),
             "embed_one_by_one": _time(one_by_one, a.trials),
             "prefill": _time(prefill, a.trials)}
    rows = [{"what": k, "seconds": round(v, 4), "tokens_per_s": round(tokens / v, 1),
             "vs_prefill": round(times["prefill"] / v, 3)} for k, v in times.items()]
    result = {"machine": machine(), "model": str(path), "preset": None if a.model else a.preset,
              "dtype": None if a.model else a.dtype,
              "inputs": a.inputs, "tokens": tokens, "trials": a.trials, "rows": rows}
    out = Path(a.out) if a.out else report_dir("embed_cost", a.tag)
    out.mkdir(parents=True, exist_ok=True)
    dump_json(out / "embed_cost.json", result)
    table = md_table(["what", "seconds", "tokens/s", "speed vs prefill"],
                     [[r["what"], r["seconds"], r["tokens_per_s"], r["vs_prefill"]] for r in rows])
    (out / "embed_cost.md").write_text(
        f"# Embeddings vs prefill ({result['preset'] or path.name}, {a.inputs} inputs, "
        f"{tokens} tokens, median of {a.trials})\n\n{table}\n\n"
        f"Machine: {result['machine']}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
