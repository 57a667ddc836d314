"""One decode step of the one-kernel step on a GPU, and whether it ran: for finding a kernel's
fault with a tool around it, e.g. compute-sanitizer (which names the faulting instruction's
offset and threads), where a sweep would only see the CUDA error.

    compute-sanitizer --tool memcheck python experiments/mega_first_step.py --model DIR \
        [--prompt 8] [--env MLXP_MEGA_QKNORM=0 ...]

Prints when the prompt was processed, then `ok SECONDS` (the step ran; the seconds include
compiling the kernel) or `ERR SECONDS MESSAGE`; exit status 0 or 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings for the kernel")
    a = ap.parse_args(argv)
    settings = dict(kv.partition("=")[::2] for kv in a.env)
    t0 = time.time()
    import mlx.core as mx

    from engine.fast.decode import FastDecoder, FastStep
    from engine.levers import resolve
    from engine.loader import load_model
    try:
        model = load_model(a.model)[0]
    except Exception as e:  # noqa: BLE001  (a model that does not load: a message, not a traceback)
        print(f"mega_first_step: {e}", file=sys.stderr)
        return 2
    prompt = [(7 * i + 3) % 1000 + 1 for i in range(a.prompt)]
    try:
        levers = resolve("l3", env={**os.environ, **settings})
    except ValueError as e:
        print(f"mega_first_step: {e}", file=sys.stderr)
        return 2
    dec = FastDecoder(FastStep(model, levers))
    caches = model.make_cache()
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    print("prompt done", round(time.time() - t0, 2), flush=True)
    t1 = time.time()
    try:
        mx.eval(dec(mx.array([prompt[-1]]), caches))
    except Exception as e:  # noqa: BLE001  (the kernel's error is the result)
        print("ERR", round(time.time() - t1, 2), e, flush=True)
        return 1
    print("ok", round(time.time() - t1, 2), "one_kernel" if dec.stats.mega else dec.stats.mega_reason, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
