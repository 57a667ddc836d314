"""Which levers keep L1's exact logits on this device? Per-step log-probs of the token
loop with a lever spec against the plain L1 loop on the same model (teacher: L1 greedy).

    python experiments/l3_exactness.py --model DIR [--specs l1+merged_proj,l3-perf_kernel-fused_sdpa,l3]

On the CPU all of them are exact (tests/parity/test_levers_l1.py, test_l3_gate.py);
this script asks the same question where kernels differ (the GPU). Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast.apply import decoder_for  # noqa: E402
from engine.fast.merge import merge_projections  # noqa: E402
from engine.levers import parse_spec  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.step.stepper import generate_step  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--specs", default="l1+merged_proj,l3-perf_kernel-fused_sdpa,l3")
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args(argv)
    prompt = mx.array(np.random.default_rng(0).integers(32, 1000, size=100).tolist())
    base = load_model(a.model)[0]
    ref = list(generate_step(prompt, base, max_tokens=a.steps))
    for spec in a.specs.split(","):
        lv = parse_spec(spec)
        m = load_model(a.model)[0]
        dec = decoder_for(m, lv)
        if lv.merged_proj and dec is None:
            merge_projections(m)
        got = list(generate_step(prompt, m, max_tokens=a.steps, decoder=dec))
        eq = [bool(mx.array_equal(x[1], y[1]).item()) for x, y in zip(ref, got)]
        diff = max(float(mx.abs(x[1] - y[1]).max().item()) for x, y in zip(ref, got))
        print(json.dumps({"spec": spec, "device": str(mx.default_device()), "steps": len(eq),
                          "equal_steps": sum(eq), "same_tokens": [t for t, _ in ref] == [t for t, _ in got],
                          "max_abs_logprob_diff": diff}), flush=True)
        del m, dec
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
