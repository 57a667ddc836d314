"""The fast runner's verify step (engine.fast.slots.SlotPool.verify) on a GPU: its logits
against single fast steps, and its cost against a plain step.

For each model: `rows` rows with random prompts of different lengths go into two slot pools;
one takes K + 1 plain steps (one token a row each), the other one verify step of the same
tokens (each row's K + 1 call rows sharing its slot). Per position: bit-equal, the largest
absolute difference, argmax equal, and whether every key and value the verify wrote equals the
single steps' (else the first layer and position that differ). Then timings (median of `trials` after a warm-up): a plain
step of `rows` rows, and a verify step of K + 1 positions a row, for each K of --ks, so a
speculation round's cost is known: a round of K drafts costs one verify plus the drafts'
steps and hands out between 1 and K + 1 tokens. With MLXP_MEGA_PROF=1 (the one kernel built with
its phase timer) also each phase's time of the plain step and of the verify (where a verify's
extra rows cost).

    python experiments/fast_verify_gpu.py --model DIR [--model DIR2] [--rows 1,8] [--ks 2,4,8]
        [--out DIR]
    MLXP_MEGA_PROF=1 python experiments/fast_verify_gpu.py ...     # and the phases' times
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast.apply import fast_step_for  # noqa: E402
from engine.fast.slots import SlotPool  # noqa: E402
from engine.levers import resolve  # noqa: E402
from engine.loader import load_model  # noqa: E402
from experiments._common import command, machine, write_table  # noqa: E402

FIELDS = ["model", "rows", "k", "bit_equal", "positions", "max_abs_diff", "argmax_equal",
          "keys_equal", "first_key_diff", "plain_ms", "verify_ms", "verify_over_plain", "one_kernel",
          "plain_phases_us", "verify_phases_us"]


def _first_kv_diff(a: SlotPool, b: SlotPool, starts: list, k: int):
    """(whether every key and value the verify wrote equals the single steps', the first
    (layer, 'k' or 'v', row, position) that does not, or None)."""
    for layer in range(a.n_layers):
        for name, xa, xb in (("k", a.keys[layer], b.keys[layer]), ("v", a.values[layer], b.values[layer])):
            for i, (sa, sb, n) in enumerate(zip(a.slots, b.slots, starts)):
                for j in range(k + 1):
                    if not mx.array_equal(xa[sa, :, n + j], xb[sb, :, n + j]).item():
                        return False, f"layer {layer} {name} row {i} position {j}"
    return True, None


def _timed(fn, trials: int) -> float:
    """Median ms of `trials` calls of fn (each evaluated), after two untimed calls."""
    for _ in range(2):
        mx.eval(fn())
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(1000 * (time.perf_counter() - t0))
    return statistics.median(ts)


def check(model, name: str, rows: int, k: int, trials: int, seed: int = 0) -> dict:
    step = fast_step_for(model, resolve("l3"))
    rng = random.Random(seed)
    V = model.args.vocab_size
    prompts = [[rng.randrange(4, V - 4) for _ in range(64 + 37 * i)] for i in range(rows)]
    feed = [[rng.randrange(4, V - 4) for _ in range(k + 1)] for _ in range(rows)]
    a = SlotPool.of_prompts(step, model, prompts)
    starts = [len(p) for p in prompts]
    seq = mx.stack([a(mx.array([f[j] for f in feed], dtype=mx.int32)) for j in range(k + 1)], axis=1)
    b = SlotPool.of_prompts(step, model, prompts)
    v = b.verify(mx.array(feed, dtype=mx.int32), [k + 1] * rows)
    mx.eval(seq, v)
    # (where the two first part: the keys and values each wrote, layer by layer)
    keys_equal, first_diff = _first_kv_diff(a, b, starts, k)
    one_kernel = step.stats.mega
    diff = mx.abs(v.astype(mx.float32) - seq.astype(mx.float32))
    eq = [mx.array_equal(v[i, j], seq[i, j]).item() for i in range(rows) for j in range(k + 1)]
    arg = (mx.argmax(v, axis=-1) == mx.argmax(seq, axis=-1))
    # timings: the plain step and the verify step, each rewound after itself (same columns)
    toks1 = mx.array([f[0] for f in feed], dtype=mx.int32)
    toksk = mx.array(feed, dtype=mx.int32)

    def plain():
        out = a(toks1)
        a.rewind([1] * rows)
        return out

    def verify():
        out = b.verify(toksk, [k + 1] * rows)
        b.rewind([k + 1] * rows)
        return out
    b.rewind([k + 1] * rows)
    plain_ms = _timed(plain, trials)
    plain_phases = _phases(step)
    verify_ms = _timed(verify, trials)
    verify_phases = _phases(step)
    return dict(model=name, rows=rows, k=k, bit_equal=sum(eq), positions=len(eq),
                max_abs_diff=round(diff.max().item(), 6), argmax_equal=int(arg.sum().item()),
                keys_equal=keys_equal, first_key_diff=first_diff,
                plain_ms=round(plain_ms, 3), verify_ms=round(verify_ms, 3),
                verify_over_plain=round(verify_ms / plain_ms, 3), one_kernel=one_kernel,
                plain_phases_us=plain_phases, verify_phases_us=verify_phases)


def _phases(step) -> str:
    """The one kernel's phase times (µs) of the step's last call, with MLXP_MEGA_PROF=1
    (a build with the phase timer), as "phase=µs ..."; "" otherwise."""
    prof = step.mega_profile()
    return " ".join(f"{k}={round(v)}" for k, v in prof.items() if not isinstance(v, dict))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out_rows = []
    for path in a.model:
        model = load_model(path)[0]
        for r in [int(x) for x in a.rows.split(",")]:
            for k in [int(x) for x in a.ks.split(",")]:
                row = check(model, Path(path).name, r, k, a.trials)
                print(json.dumps(row), flush=True)
                out_rows.append(row)
        del model
    if a.out:
        write_table(Path(a.out), "fast_verify", FIELDS, out_rows,
                    "The fast runner's verify step against single fast steps",
                    f"Machine: {machine()}. Reproduce: `{command('fast_verify_gpu.py', argv)}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
