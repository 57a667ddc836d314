"""`engine-train`: LoRA / QLoRA fine-tuning with mlx-lm's data formats and adapter files.

    engine-train --model DIR --data DIR --adapter-path OUT [--iters N --batch-size B
                 --learning-rate LR --rank R --scale S --dropout P --num-layers K
                 --max-seq-length L --grad-accumulation G --grad-checkpoint
                 --segment-size S --val-batches V --seed SEED ...]

The adapter directory it writes (`adapters.safetensors` + `adapter_config.json`)
loads in `mlx_lm.load(model, adapter_path=OUT)`, `engine.load(model,
adapter_path=OUT)` and `engine-generate --adapter-path OUT`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

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
    "num_layers": "train the last K blocks; -1 = all (default: 16, or all if fewer)",
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

    p = argparse.ArgumentParser(prog="engine-train", description="LoRA fine-tuning (mlx-parity)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
        if f.name in ("model", "data"):
            kw["required"] = True
        else:
            kw["default"] = None if f.name in COMPUTED else f.default
        if f.name in choices:
            kw["choices"] = choices[f.name]
        kw["type"] = str if f.name == "keys" else _type(f)
        p.add_argument(*names, **kw)
    p.add_argument("--train", action="store_true", help="accepted for mlx-lm compatibility")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import engine
    from engine.loader import ModelLoadError

    from .data import DataError, load_data_dir
    from .trainer import TrainConfig, train

    try:
        model, tok = engine.load(args.model)
    except (ModelLoadError, FileNotFoundError, ValueError) as e:
        print(f"engine-train: cannot load model: {e}", file=sys.stderr)
        return 2
    try:
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
    if args.keys is not None:
        args.keys = args.keys.split(",")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
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
        meta = {"engine_version": engine.__version__}
        train(model, cfg, train_set, valid_set, meta=meta)
    except (ValueError, DataError, FileNotFoundError) as e:
        print(f"engine-train: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
