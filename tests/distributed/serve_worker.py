"""One rank of the served tensor-parallel checks (run under `mlx.launch`).

    mlx.launch -n 2 --backend ring -- python3 tests/distributed/serve_worker.py OUT MODEL SPEC \
        ENGINE-SERVE-ARGS...

First the reference: the text `engine.generate` gives for the sharded model (the same
launch, `engine.load(MODEL, tensor_parallel=True)`) for each request of SPEC (a JSON list
of {"prompt", "max_tokens", "temperature", "seed"}); written with this rank's pid to
OUT/rank<R>.json. Then `engine-serve --tensor-parallel ENGINE-SERVE-ARGS` in this process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv):
    out, model, spec, serve_args = Path(argv[0]), argv[1], json.loads(argv[2]), argv[3:]
    import mlx.core as mx

    import engine
    from server.cli import main as serve

    rank = mx.distributed.init().rank()
    m, tok = engine.load(model, tensor_parallel=True)
    texts = [engine.generate(m, tok, r["prompt"], max_tokens=r["max_tokens"],
                             temperature=r["temperature"], seed=r.get("seed")).text
             for r in spec]
    del m
    mx.synchronize()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(),
                                                      "texts": texts}))
    return serve(["--model", model, "--tensor-parallel", *serve_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
