"""`engine-train`: LoRA / QLoRA fine-tuning with mlx-lm's data formats and adapter files.

    engine-train --model DIR --data DIR --adapter-path OUT [--iters N --batch-size B
                 --learning-rate LR --rank R --scale S --dropout P --num-layers K
                 --max-seq-length L --grad-accumulation G --grad-checkpoint
                 --segment-size S --val-batches V --seed SEED --test ...]
    engine-train -c lora.yaml [flags that override the file]

The flags and the config file (`-c`, YAML) are mlx_lm.lora's; see train/config_file.py
for how its keys map.

The adapter directory it writes (`adapters.safetensors` + `adapter_config.json`)
loads in `mlx_lm.load(model, adapter_path=OUT)`, `engine.load(model,
adapter_path=OUT)` and `engine-generate --adapter-path OUT`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from engine.argparsing import CliParser, DefaultsHelpFormatter

# Help texts of `TrainConfig`'s fields; the flags, their types and defaults come from the
# dataclass itself (one place). Flag = the field name with dashes (mlx-lm's names).
HELP = {
    "iters": "optimizer steps to run",
    "batch_size": "sequences per micro-step",
    "learning_rate": "optimizer learning rate",
    "rank": "LoRA rank r",
    "scale": "LoRA scale (the adapter's output is multiplied by it)",
    "dropout": "LoRA dropout probability",
    "max_seq_length": "longer sequences are cut to this many tokens",
    "grad_accumulation": "micro-steps whose gradients are summed into one optimizer step",
    "steps_per_report": "log the training loss every N steps",
    "steps_per_eval": "validate every N steps (and at the first and last)",
    "save_every": "write the adapter (and the training state for --resume) every N steps",
    "seed": "seed of the LoRA initialisation and the batch order",
    "clear_cache_threshold": "clear MLX's buffer cache when it exceeds N bytes (0 = never)",
    "model": "model directory (HF/MLX layout, may be quantized) or Hugging Face repo id",
    "data": "directory with train.jsonl [valid.jsonl]",
    "adapter_path": "output adapter directory",
    "optimizer": "optimizer",
    "weight_decay": "adamw / sgd weight decay",
    "momentum": "sgd momentum",
    "num_layers": "train the last K blocks; -1 = all (default: 16, or all if the model has "
                  "fewer)",
    "keys": "comma-separated target paths (default: every linear in the blocks)",
    "grad_checkpoint": "recompute each block in the backward (mx.checkpoint)",
    "segment_size": "segmented backward with S blocks per segment (0 = off)",
    "mlp_chunk": "with --segment-size 1: run each block's MLP half N tokens at a time "
                 "(lower peak; MLP LoRA grads re-associated, ~1e-7 relative)",
    "token_chunk": "with --segment-size 1: run every per-token part of each block (norms, "
                   "q/k/v/o projections, RoPE, MLP) N tokens at a time; only attention sees "
                   "the whole sequence (lowest peak; LoRA grads re-associated)",
    "attn_block": "with --token-chunk: attention's forward and backward in blocks of N query "
                  "rows, each attending to its own key prefix and cut into head groups under "
                  "the fused kernel's size limit; 0 = automatic (blocks of 8192 rows beyond "
                  "32768 tokens), -1 = never (dk/dv re-associated, ~1e-6 relative)",
    "loss_head": "full [B,T,vocab] logits (default without --segment-size) or only the "
                 "counted positions, optionally in checkpointed chunks (default with it)",
    "chunk_size": "rows per chunk (chunked head)",
    "val_batches": "-1 = the whole valid set",
    "mask_prompt": "loss on the response only (default; --no-mask-prompt: every token, "
                   "mlx-lm's default)",
    "resume": "continue from the training state saved in --adapter-path",
    "resume_adapter_file": "start from these adapter weights (mlx-lm's flag; no optimiser "
                           "state)",
    "compile": "compile the training step (default; --no-compile: eager)",
}
FLAG = {"keys": "--lora-keys"}                       # field -> flag, where not the field name
ALIASES = {"grad_accumulation": ["--grad-accumulation-steps"]}
COMPUTED = {"num_layers", "loss_head"}               # default depends on the model / mode


def _type(f):
    t = str(f.type)
    return float if "float" in t else int if "int" in t else str


def build_parser():
    from .trainer import OPTIMIZERS, TrainConfig
    from .loss import HEADS

    p = CliParser(prog="engine-train", description="LoRA fine-tuning (mlx-parity)",
                  formatter_class=DefaultsHelpFormatter)
    p.add_argument("-c", "--config", metavar="FILE",
                   help="mlx-lm LoRA config file (YAML; keys named like the flags, flags win)")
    choices = {"optimizer": OPTIMIZERS, "loss_head": HEADS}
    for f in dataclasses.fields(TrainConfig):
        flag = FLAG.get(f.name, "--" + f.name.replace("_", "-"))
        names = [flag] + ALIASES.get(f.name, [])
        kw = {"dest": f.name, "help": HELP.get(f.name, "")}
        if isinstance(f.default, bool):
            if f.default:     # on by default: --name (explicit) and --no-name
                p.add_argument(*names, action="store_true", default=True, **kw)
                p.add_argument("--no-" + flag[2:], dest=f.name, action="store_false",
                               help=argparse.SUPPRESS)
            else:
                p.add_argument(*names, action="store_true", **kw)
            continue
        if f.name not in ("model", "data"):     # (model and data: checked after -c)
            kw["default"] = None if f.name in COMPUTED else f.default
        if f.name in choices:
            kw["choices"] = choices[f.name]
        kw["type"] = str if f.name == "keys" else _type(f)
        p.add_argument(*names, **kw)
    p.add_argument("--train", action="store_true",
                   help="train (what engine-train does unless only --test is given)")
    p.add_argument("--fine-tune-type", choices=["lora", "dora", "full"], default="lora",
                   help="lora (dora and full fine-tuning are not implemented)")
    p.add_argument("--test", action="store_true",
                   help="report the loss on DATA/test.jsonl (after training; alone: of the "
                        "adapters in --adapter-path)")
    p.add_argument("--test-batches", type=int, default=500, help="-1 = the whole test set")
    p.add_argument("--report-to", help="experiment trackers (mlx-lm: wandb, swanlab): not "
                   "supported; the progress lines go to stdout")
    p.add_argument("--project-name", help="tracker project name (with --report-to)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for mlx-lm compatibility (no model code is downloaded)")
    return p


def parse_args(argv=None):
    """Flags over the -c file over the defaults, as mlx_lm.lora resolves them."""
    from .config_file import ConfigError, read_config

    p = build_parser()
    first = p.parse_known_args(argv)[0]
    if first.config:
        try:
            p.set_defaults(**read_config(first.config, {a.dest for a in p._actions}))
        except ConfigError as e:
            p.error(str(e))
    args = p.parse_args(argv)
    missing = [f"--{n}" for n in ("model", "data") if not getattr(args, n)]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)} (or in -c FILE)")
    if args.fine_tune_type != "lora":
        p.error(f"--fine-tune-type {args.fine_tune_type} is not supported: engine-train "
                "trains LoRA adapters only")
    if args.report_to:
        p.error(f"--report-to {args.report_to} is not supported: engine-train has no "
                "experiment-tracker integration (progress lines go to stdout)")
    if Path(args.data).is_file():
        p.error(f"--data {args.data} is a file; engine-train reads a directory holding "
                "train.jsonl, valid.jsonl and test.jsonl (mlx-lm's layout)")
    return args


def run_test(model, data, args, cfg, rng, log=print) -> bool:
    """mlx-lm's `--test`: the loss and perplexity over DATA/test.jsonl."""
    from .data import DataError
    from .trainer import evaluate

    test_set = data.get("test")
    if test_set is None or len(test_set) == 0:
        raise DataError(f"{args.data}: test.jsonl is missing or empty (needed by --test)")
    loss = evaluate(model, test_set, cfg.batch_size, args.test_batches, cfg.max_seq_length, rng,
                    head=cfg.loss_head, chunk_size=cfg.chunk_size)
    log(f"Test loss {loss:.3f}, Test ppl {math.exp(loss):.3f}.")
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    import engine
    import numpy as np
    from engine.loader import ModelLoadError

    from .data import DataError, load_data_dir, load_dataset
    from .trainer import TrainConfig, train

    test_only = args.test and not args.train       # mlx-lm: test the saved adapters
    try:
        model, tok = engine.load(args.model, adapter_path=args.adapter_path if test_only else None)
    except (ModelLoadError, FileNotFoundError, ValueError) as e:
        print(f"engine-train: cannot load model: {e}", file=sys.stderr)
        return 2
    try:
        if test_only:
            f = Path(args.data) / "test.jsonl"
            data = {"test": load_dataset(f, tok, args.mask_prompt) if f.exists() else None}
        else:
            data = load_data_dir(args.data, tok, mask_prompt=args.mask_prompt)
    except (DataError, OSError) as e:
        print(f"engine-train: {e}", file=sys.stderr)
        return 2
    n_layers = len(model.layers)
    if args.num_layers is None:
        args.num_layers = 16 if n_layers >= 16 else -1
    if args.num_layers > n_layers:
        print(f"engine-train: --num-layers {args.num_layers} but the model has {n_layers} "
              "blocks", file=sys.stderr)
        return 2
    if args.loss_head is None:
        args.loss_head = "chunked" if args.segment_size else "full"
    if isinstance(args.keys, str):
        args.keys = args.keys.split(",")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if test_only:
        try:
            run_test(model, data, args, cfg, np.random.RandomState(cfg.seed))
        except (ValueError, DataError) as e:
            print(f"engine-train: {e}", file=sys.stderr)
            return 2
        return 0
    train_set, valid_set = data["train"], data["valid"]
    from .distributed import data_parallel
    main_rank = data_parallel().is_main  # under mlx.launch only rank 0 prints
    if valid_set is None or len(valid_set) == 0:
        if main_rank:
            print("engine-train: no valid.jsonl; training without validation", file=sys.stderr)
        valid_set = None
    if main_rank:
        print(f"Loaded {len(train_set)} train / {0 if valid_set is None else len(valid_set)} valid "
              f"examples ({train_set.format} format, prompt masking "
              f"{'on' if args.mask_prompt else 'off'})")
    try:
        if args.test and not data.get("test"):
            raise DataError(f"{args.data}: test.jsonl is missing or empty (needed by --test)")
        meta = {"engine_version": engine.__version__}
        _, trainer = train(model, cfg, train_set, valid_set, meta=meta)
        if args.test:
            run_test(model, data, args, cfg, trainer.rng, log=print if main_rank else
                     (lambda _: None))
    except (ValueError, DataError, FileNotFoundError) as e:
        print(f"engine-train: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
