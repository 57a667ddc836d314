"""Why a verify's later positions part from single steps on the one kernel (fast_verify 0.6.1:
position 0 bit-equal, position 1 on not, the first layer's keys and values all equal).

One row, its prompt, then two tokens (t0, t1), four ways, each giving position 1's logits
(after t0, t1) and position 0's:
  A  single steps of a one-row pool (one-row calls: FLOW 1, no grid barrier before attention);
  B  one verify of both tokens (a call of 2 rows, row 1 reading the key/value row 0 wrote in
     the same launch);
  C  plain steps of a two-row pool, the row and a copy of it in another slot (calls of 2 rows,
     FLOW 0, each row reading only keys earlier launches wrote);
  D  two verifies of one token each (a verify's call rows, but one a launch).
A = C but A != B: the difference is reading a key/value written in the same launch by another
call row; B = C but != A: it is the several-row build itself (FLOW 0, the barrier). On the CPU
every way is bit-equal (the stock-MLX stand-ins).

    python -m experiments.presets 1b /tmp/m/1b-l1 --layers 1     # one layer: its own output
    python experiments/verify_exactness_gpu.py --model /tmp/m/1b --model /tmp/m/1b-l1 [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast.apply import fast_step_for  # noqa: E402
from engine.fast.slots import SlotPool  # noqa: E402
from engine.levers import resolve  # noqa: E402
from engine.loader import load_model  # noqa: E402


def ways(model, prompt: list, t0: int, t1: int) -> dict:
    """{way: logits [2, V]} (positions 0 and 1) for the four ways of the module's docstring."""
    step = fast_step_for(model, resolve("l3"))
    one = lambda t: mx.array([t], dtype=mx.int32)   # noqa: E731
    a = SlotPool.of_prompts(step, model, [prompt])
    out = {"A": mx.concatenate([a(one(t0)), a(one(t1))])}
    b = SlotPool.of_prompts(step, model, [prompt])
    out["B"] = b.verify(mx.array([[t0, t1]], dtype=mx.int32), [2])[0]
    c = SlotPool.of_prompts(step, model, [prompt, prompt])
    out["C"] = mx.concatenate([c(mx.array([t0, t0], dtype=mx.int32))[:1],
                               c(mx.array([t1, t1], dtype=mx.int32))[:1]])
    d = SlotPool.of_prompts(step, model, [prompt])
    out["D"] = mx.concatenate([d.verify(mx.array([[t]], dtype=mx.int32), [1])[0] for t in (t0, t1)])
    mx.eval(out)
    return out


def compare(out: dict) -> dict:
    """Per pair of ways and position: bit-equal, and the largest absolute difference."""
    res = {}
    for x, y in (("A", "B"), ("A", "C"), ("B", "C"), ("A", "D")):
        for j in range(2):
            u, v = out[x][j].astype(mx.float32), out[y][j].astype(mx.float32)
            res[f"{x}{y}_pos{j}"] = {"equal": bool(mx.array_equal(out[x][j], out[y][j]).item()),
                                     "max_abs_diff": round(mx.abs(u - v).max().item(), 6)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    for path in a.model:
        model = load_model(path)[0]
        V = model.args.vocab_size
        for seed in range(a.seeds):
            rng = random.Random(seed)
            prompt = [rng.randrange(4, V - 4) for _ in range(a.prompt)]
            row = {"model": Path(path).name, "layers": len(model.layers), "seed": seed,
                   "device": str(mx.default_device()),
                   **compare(ways(model, prompt, rng.randrange(4, V - 4), rng.randrange(4, V - 4)))}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del model
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
