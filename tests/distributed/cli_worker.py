"""One rank of the command-line checks (run under `mlx.launch`).

    mlx.launch -n 2 --backend ring -- python3 tests/distributed/cli_worker.py OUT TP_MODEL MODEL DATA

1. `engine-generate --tensor-parallel` on TP_MODEL: what it prints (rank 0) and
   the text `engine.generate` gives for the same sharded model and prompt.
2. `engine-train` data-parallel: 4 iterations straight, and 2 + `--resume` to 4;
   rank 0 writes both adapter directories under OUT.
Each rank's stdout and return codes go to OUT/rank<R>.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import mlx.core as mx

PROMPT = "def add(a, b):\n    return"


def captured(fn, argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = fn(argv)
    mx.synchronize()
    return rc, buf.getvalue()


def main(argv):
    out, tp_model, model, data = (Path(a) for a in argv[:4])
    import engine
    from engine.cli import main as generate_cli
    from train.cli import main as train_cli

    rank = mx.distributed.init().rank()
    res = {"rank": rank, "size": mx.distributed.init().size()}
    rc, text = captured(generate_cli, ["--model", str(tp_model), "--prompt", PROMPT,
                                       "--max-tokens", "8", "--temp", "0", "--tensor-parallel",
                                       "--ignore-chat-template"])
    m, tok = engine.load(tp_model, tensor_parallel=True)
    res["generate"] = {"rc": rc, "stdout": text, "expected": engine.generate(
        m, tok, PROMPT, max_tokens=8, temperature=0.0).text}
    mx.synchronize()
    common = ["--model", str(model), "--data", str(data), "--batch-size", "4",
              "--learning-rate", "1e-3", "--num-layers", "-1", "--steps-per-report", "1",
              "--val-batches", "1", "--steps-per-eval", "2", "--save-every", "2"]
    runs = [("straight", ["--iters", "4"]), ("first_half", ["--iters", "2"]),
            ("resumed", ["--iters", "4", "--resume"])]
    res["train"] = {}
    for name, extra in runs:
        target = out / ("straight" if name == "straight" else "resumed")
        rc, text = captured(train_cli, common + extra + ["--adapter-path", str(target)])
        res["train"][name] = {"rc": rc, "stdout": text}
    rc, _ = captured(train_cli, common + ["--iters", "2", "--batch-size", "3",
                                          "--adapter-path", str(out / "bad")])
    res["bad_batch_rc"] = rc
    (out / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1:])
