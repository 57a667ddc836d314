"""The one-kernel decode step (engine.fast.mega) against the L3 step of separate kernels
and against L1, on the same tokens (teacher-forced), on a GPU.

For one prompt, L1 continues it greedily for --steps tokens; the three paths are then fed
that sequence from their own prefilled caches, and at every step we compare logits:
relative error ‖a − b‖ / ‖b‖ (float32), top-1 agreement, and KL(p_L1 ‖ p). Also: whether
the kernel ran (`FastDecoder.stats.mega`, or why not) and the keys the step wrote into the
caches against L1's.

    python experiments/mega_check.py --model DIR [--steps 24] [--prompt 128] [--out FILE.json]
    MLXP_MEGA_PROF=1 python experiments/mega_check.py ...   # also the step's phase times (µs)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast.decode import FastDecoder, FastStep  # noqa: E402
from engine.levers import resolve, with_levers  # noqa: E402
from engine.loader import load_model  # noqa: E402
from experiments._common import add_one_kernel_flag, apply_one_kernel_flag  # noqa: E402


def _rel(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def _kl(p_logits, q_logits) -> float:
    lp = p_logits.astype(mx.float32) - mx.logsumexp(p_logits.astype(mx.float32), axis=-1, keepdims=True)
    lq = q_logits.astype(mx.float32) - mx.logsumexp(q_logits.astype(mx.float32), axis=-1, keepdims=True)
    return mx.sum(mx.exp(lp) * (lp - lq)).item()


def run_path(model, prompt, seq, path: str):
    """Logits [steps, V] of `path` (l1, nomega, mega) fed seq after the prompt; the stats."""
    caches = model.make_cache()
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    out, stats = [], None
    lv = resolve("l3")                      # (the fast path's settings from the environment)
    if path == "nomega":
        lv = with_levers(lv, fast=replace(lv.fast, disabled=lv.fast.disabled | {"mega"}))
    dec = None if path == "l1" else FastDecoder(FastStep(model, lv))
    y = mx.array([prompt[-1]])
    for t in seq:
        if dec is None:
            lg = model(y[:, None], cache=caches)[:, -1]
        else:
            lg = dec(y, caches)
        mx.eval(lg)
        out.append(lg.reshape(-1))
        y = mx.array([t])
    stats = dict(dec.stats.__dict__) if dec is not None else None
    if dec is not None and dec.mega_profile():
        stats["profile_us"] = dec.mega_profile()     # (MLXP_MEGA_PROF=1: the last step's phases)
    keys = caches[0].keys[..., :caches[0].offset, :]
    return mx.stack(out), stats, keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", default=None)
    add_one_kernel_flag(ap)
    a = ap.parse_args(argv)
    apply_one_kernel_flag(a)
    model = load_model(a.model)[0]
    vocab = model.args.vocab_size
    prompt = [(7 * i + 3) % (vocab - 1) + 1 for i in range(a.prompt)]
    # L1's greedy continuation is the teacher-forced sequence
    caches = model.make_cache()
    lg = model(mx.array(prompt)[None], cache=caches)[:, -1]
    seq = []
    for _ in range(a.steps):
        t = int(mx.argmax(lg, axis=-1).item())
        seq.append(t)
        lg = model(mx.array([[t]]), cache=caches)[:, -1]
    res = {p: run_path(model, prompt, seq, p) for p in ("l1", "nomega", "mega")}
    l1 = res["l1"][0]
    rows = {}
    for p in ("nomega", "mega"):
        lg, stats, keys = res[p]
        rows[p] = {"rel_err_vs_l1": _rel(lg, l1),
                   "top1_vs_l1": mx.mean(mx.argmax(lg, -1) == mx.argmax(l1, -1)).item(),
                   "mean_kl_vs_l1": sum(_kl(l1[i], lg[i]) for i in range(len(seq))) / len(seq),
                   "keys_rel_err_vs_l1": _rel(keys, res["l1"][2]),
                   "stats": {k: v for k, v in (stats or {}).items() if k != "gemv_choice"}}
    rows["mega_vs_nomega"] = {"rel_err": _rel(res["mega"][0], res["nomega"][0]),
                              "top1": mx.mean(mx.argmax(res["mega"][0], -1)
                                              == mx.argmax(res["nomega"][0], -1)).item()}
    rows["device"] = str(mx.default_device())
    print(json.dumps(rows, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
