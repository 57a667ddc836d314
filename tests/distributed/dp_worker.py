"""One rank of the data-parallel training parity check (run under `mlx.launch`).

    mlx.launch -n 2 --backend ring -- python3 tests/distributed/dp_worker.py OUT DATA SPEC...

SPEC is FAMILY:DTYPE[:MODE] with MODE `full` (compiled full backward, default) or
`segmented` (segment size 1, chunked loss head). mlx-lm's own trainer
(`mlx_lm.lora.train_model`, which averages gradients over `mx.distributed.init()`)
and ours run k Adam steps on the same data under the same launch; each rank
compares the two sets of in-memory LoRA weights with `mx.array_equal`. Rank 0's
files land in OUT/<spec>/{ref,ours}. Writes OUT/rank<R>.json.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.loader import load_model
from engine.adapters.lora import adapter_weights
from engine.text.tokenizer import load_tokenizer
from parity.fixtures.models import ensure_fixture
from train.data import load_data_dir
from train.trainer import TrainConfig, train

COMMON = dict(iters=4, batch_size=4, learning_rate=1e-3, seed=0, steps_per_eval=3,
              val_batches=1, steps_per_report=2, save_every=100)
G = 2
MODES = {"full": {}, "segmented": dict(segment_size=1, loss_head="chunked", chunk_size=16)}


def mlx_lm_run(path: Path, data: Path, out: Path) -> dict:
    import mlx_lm
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset
    over = dict(model=str(path), train=True, data=str(data), num_layers=-1, mask_prompt=True,
                adapter_path=str(out), grad_accumulation_steps=G, optimizer="adam", **COMMON)
    args = types.SimpleNamespace(**{**CONFIG_DEFAULTS, **over})
    np.random.seed(args.seed)  # what mlx_lm.lora.run does first
    model, tok = mlx_lm.load(str(path))
    tr, va, _ = load_dataset(args, tok)
    train_model(args, model, tr, va)
    return adapter_weights(model)


def our_run(path: Path, data: Path, out: Path, mode: str):
    model = load_model(path)[0]
    d = load_data_dir(data, load_tokenizer(path), mask_prompt=True)
    cfg = TrainConfig(model=str(path), data=str(data), adapter_path=str(out), num_layers=-1,
                      grad_accumulation=G, **COMMON, **MODES[mode])
    logged = []
    hist, _ = train(model, cfg, d["train"], d["valid"], log=logged.append)
    return adapter_weights(model), hist, logged


_REF: dict = {}


def check(out: Path, data: Path, spec: str) -> dict:
    family, dtype, *rest = spec.split(":")
    mode = rest[0] if rest else "full"
    path = ensure_fixture(family, dtype)
    d = out / spec.replace(":", "-")
    if (family, dtype) not in _REF:  # one mlx-lm run serves every mode
        _REF[family, dtype] = mlx_lm_run(path, data, out / f"{family}-{dtype}-ref")
    ref = _REF[family, dtype]
    ours, hist, logged = our_run(path, data, d / "ours", mode)
    same = sorted(ref) == sorted(ours)
    return {"spec": spec, "names_equal": same, "n_tensors": len(ours),
            "unequal": [k for k in sorted(ref) if same and not mx.array_equal(ref[k], ours[k])],
            "val_losses": [h["val_loss"] for h in hist if "val_loss" in h],
            "train_losses": [h["train_loss"] for h in hist if "train_loss" in h],
            "log_lines": len(logged)}


def main(argv):
    out, data = Path(argv[0]), Path(argv[1])
    group = mx.distributed.init()
    results = [check(out, data, spec) for spec in argv[2:]]
    (out / f"rank{group.rank()}.json").write_text(json.dumps(
        {"rank": group.rank(), "size": group.size(), "results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
