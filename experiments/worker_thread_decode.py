"""Does decoding on a worker thread (as engine-serve's gateway does) cost anything
against the main thread? Same process, same model, paired runs.

    python experiments/worker_thread_decode.py [--model DIR] [--trials 15] [--gen 256]

Prints the median decode tok/s on each and the median of the per-pair ratios
(thread / main; 1 = no cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from experiments._decode_worker import time_ours  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the llama bf16 fixture)")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--gen", type=int, default=256)
    a = ap.parse_args(argv)
    if a.model is None:
        from parity.fixtures.models import ensure_fixture
        a.model = str(ensure_fixture("llama", "bfloat16"))
    model, tok = engine.load(a.model)
    bias = {str(i): -100.0 for i in tok.eos_token_ids}
    prompt = "hello world " * 10

    def on_thread():
        out = {}
        t = threading.Thread(target=lambda: out.update(time_ours(model, tok, prompt, a.gen, bias)))
        t.start()
        t.join()
        return out["decode_tps"]

    time_ours(model, tok, prompt, 16, bias)          # warm-up
    main_tps, thread_tps = [], []
    for _ in range(a.trials):
        main_tps.append(time_ours(model, tok, prompt, a.gen, bias)["decode_tps"])
        thread_tps.append(on_thread())
    print(f"main {statistics.median(main_tps):.1f} tok/s, thread "
          f"{statistics.median(thread_tps):.1f} tok/s, paired thread/main "
          f"{statistics.median(b / m for m, b in zip(main_tps, thread_tps)):.3f}")


if __name__ == "__main__":
    main()
