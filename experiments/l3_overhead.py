"""Is the L3 decode step bound by the GPU's work or by launching it? Same step, kernels emptied.

The step is run back to back as the token loop runs it (the next step is built and
queued before the previous one is waited for), and timed in milliseconds per step for:

- `l1`: the model's own forward over its KV cache (the L1 path);
- `l3`: the fast step (every lever of `--tier l3`), its CUDA kernels in use;
- `l3-empty`: the same step with every custom kernel returning at once
  (`engine.fast.kernels.empty_kernels`: outputs are garbage, launches and host work
  are unchanged);
- `l3-nogemv` and `l3-nogemv-empty`: the same two without the fused GEMV (MLX's own
  matmuls for the projections, which the emptying does not touch);
- `l3-nomega` (and `l3-nomega-empty`): the step of separate kernels, without the
  one-kernel step (engine.fast.mega) where that would run.

If `l3-empty` is about as slow as `l3`, the step is bound by what the host does per
kernel (building, encoding, launching), not by the GPU's work, and fewer kernels per
step is what pays; if it is much faster, the kernels' GPU time is the limit.

    python experiments/l3_overhead.py --model DIR [--prompt 128] [--steps 200] [--trials 5]
    python experiments/l3_overhead.py --quick            # CPU dry run on a fixture (no kernels)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast import kernels as K  # noqa: E402
from engine.fast.decode import FastDecoder, FastStep  # noqa: E402
from engine.levers import resolve, with_levers  # noqa: E402
from engine.loader import load_model  # noqa: E402


def per_step_ms(step, first: mx.array, steps: int) -> float:
    """Milliseconds per step with the loop pipelined one step deep."""
    nxt = step(first)
    mx.async_eval(nxt)
    mx.eval(nxt)
    t0 = time.perf_counter()
    for _ in range(steps):
        cur = nxt
        nxt = step(cur)
        mx.async_eval(nxt)
        mx.eval(cur)
    mx.eval(nxt)
    return 1e3 * (time.perf_counter() - t0) / steps


def run_mode(model, mode: str, prompt: list[int], steps: int) -> float:
    caches = model.make_cache()
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    first = mx.array([prompt[-1]])
    if mode == "l1":
        def step(y):
            return mx.argmax(model(y[:, None], cache=caches)[:, -1], axis=-1)
        return per_step_ms(step, first, steps)
    lv = resolve("l3")                      # (the fast path's settings from the environment)
    off = {k for k, on in (("gemv", "nogemv" in mode), ("mega", "nomega" in mode)) if on}
    lv = with_levers(lv, fast=replace(lv.fast, disabled=lv.fast.disabled | off))
    if mode.endswith("-empty"):
        with K.empty_kernels():
            dec = FastDecoder(FastStep(model, lv))
            return per_step_ms(lambda y: mx.argmax(dec(y, caches), axis=-1), first, steps)
    dec = FastDecoder(FastStep(model, lv))
    return per_step_ms(lambda y: mx.argmax(dec(y, caches), axis=-1), first, steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (e.g. experiments/presets.py 1b)")
    ap.add_argument("--quick", action="store_true", help="CPU dry run on the llama bf16 fixture")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--modes", default="l1,l3,l3-empty,l3-nogemv,l3-nogemv-empty")
    ap.add_argument("--out", help="also write the JSON lines here")
    a = ap.parse_args(argv)
    if a.quick or not a.model:
        from parity.fixtures.models import ensure_fixture
        a.model = str(ensure_fixture("llama", "bfloat16"))
        a.steps, a.trials = min(a.steps, 20), min(a.trials, 2)
    model = load_model(a.model)[0]
    vocab = model.args.vocab_size
    prompt = [(7 * i + 3) % (vocab - 1) + 1 for i in range(a.prompt)]
    modes = a.modes.split(",")
    times = {m: [] for m in modes}
    for _ in range(a.trials):                   # modes alternate within each trial
        for m in modes:
            times[m].append(run_mode(model, m, prompt, a.steps))
    rows = []
    for m in modes:
        ms = statistics.median(times[m])
        rows.append({"mode": m, "ms_per_step": round(ms, 4), "tok_s": round(1e3 / ms, 1),
                     "trials": a.trials, "steps": a.steps, "prompt": a.prompt,
                     "device": str(mx.default_device()), "cuda_kernels": K.cuda_available()})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
