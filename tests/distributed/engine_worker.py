"""One rank of the library tensor-parallel check (run under `mlx.launch`): a script with
no server, as a library user writes it.

    mlx.launch -n 2 --backend ring -- python3 tests/distributed/engine_worker.py OUT MODEL SPEC

First the reference every rank computes: `engine.generate` on the sharded model
(`engine.load(MODEL, tensor_parallel=True)`) for each greedy request of SPEC (a JSON list
of {"prompt", "max_tokens", "temperature", "seed"}). Then `Engine.load(MODEL,
tensor_parallel=True, max_batch=2)`: on rank 0 it returns the engine, which runs every
request of SPEC together (and one more, cancelled after two steps) and is closed by its
`with` block; on rank 1 it follows rank 0 and ends the process, whose status this
script records. Writes OUT/rank<R>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv):
    out, model, spec = Path(argv[0]), argv[1], json.loads(argv[2])
    import mlx.core as mx

    import engine
    from engine import Engine, SamplingParams
    from tests.distributed.drive import drive

    group = mx.distributed.init()
    rank = group.rank()
    m, tok = engine.load(model, tensor_parallel=True)
    reference = [list(engine.generate(m, tok, r["prompt"], max_tokens=r["max_tokens"],
                                      temperature=0.0).token_ids)
                 for r in spec if r["temperature"] == 0]
    del m
    mx.synchronize()
    report = {"rank": rank, "size": group.size(), "reference": reference}

    def write():
        (out / f"rank{rank}.json").write_text(json.dumps(report))

    try:
        eng = Engine.load(model, tensor_parallel=True, max_batch=2)
    except SystemExit as e:             # ranks > 0: rank 0 closed its engine
        report["exit"] = e.code
        write()
        raise
    with eng:
        rids = [eng.submit(r["prompt"], SamplingParams(
            max_tokens=r["max_tokens"], temperature=r["temperature"], seed=r.get("seed")))
            for r in spec]
        cancel = eng.submit("x", SamplingParams(max_tokens=100, temperature=0.0))
        got = drive(eng, rids + [cancel], cancel=cancel)
        report.update(type=type(eng).__name__, tokens=[t for t, _ in got[:-1]],
                      ends=[e for _, e in got[:-1]], cancelled=got[-1][1],
                      peak_rows=eng.stats()["peak_rows"])
    write()


if __name__ == "__main__":
    main(sys.argv[1:])
