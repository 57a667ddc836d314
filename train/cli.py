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
import sys


def build_parser():
    p = argparse.ArgumentParser(prog="engine-train", description="LoRA fine-tuning (mlx-parity)")
    p.add_argument("--model", required=True, help="model directory (HF/MLX layout, may be "
                   "quantized) or Hugging Face repo id")
    p.add_argument("--data", required=True, help="directory with train.jsonl [valid.jsonl]")
    p.add_argument("--adapter-path", default="adapters", help="output adapter directory")
    p.add_argument("--train", action="store_true", help="accepted for mlx-lm compatibility")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam")
    p.add_argument("--weight-decay", type=float, default=None, help="adamw / sgd weight decay")
    p.add_argument("--momentum", type=float, default=None, help="sgd momentum")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--scale", type=float, default=20.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--num-layers", type=int, default=None,
                   help="train the last K blocks; -1 = all (default: 16, or all if fewer)")
    p.add_argument("--lora-keys", default=None,
                   help="comma-separated target paths (default: every linear in the blocks)")
    p.add_argument("--max-seq-length", type=int, default=2048)
    p.add_argument("--grad-accumulation", "--grad-accumulation-steps", dest="grad_accumulation",
                   type=int, default=1)
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each block in the backward (mx.checkpoint)")
    p.add_argument("--segment-size", type=int, default=0,
                   help="segmented backward with S blocks per segment (0 = off)")
    p.add_argument("--mlp-chunk", type=int, default=0,
                   help="with --segment-size 1: run each block's MLP half N tokens at a time "
                        "(lower peak; MLP LoRA grads re-associated, ~1e-7 relative)")
    p.add_argument("--token-chunk", type=int, default=0,
                   help="with --segment-size 1: run every per-token part of each block (norms, "
                        "q/k/v/o projections, RoPE, MLP) N tokens at a time; only attention sees "
                        "the whole sequence (lowest peak; LoRA grads re-associated)")
    p.add_argument("--loss-head", choices=["full", "gather", "chunked"], default=None,
                   help="full [B,T,vocab] logits (default without --segment-size) or only the "
                        "counted positions, optionally in checkpointed chunks (default with it)")
    p.add_argument("--chunk-size", type=int, default=1024, help="rows per chunk (chunked head)")
    p.add_argument("--val-batches", type=int, default=25, help="-1 = the whole valid set")
    p.add_argument("--steps-per-report", type=int, default=10)
    p.add_argument("--steps-per-eval", type=int, default=200)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mask-prompt", dest="mask_prompt", action="store_true", default=True,
                   help="loss on the response only (default)")
    p.add_argument("--no-mask-prompt", dest="mask_prompt", action="store_false",
                   help="loss on every token (mlx-lm's default)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the training state saved in --adapter-path")
    p.add_argument("--resume-adapter-file", default=None,
                   help="start from these adapter weights (mlx-lm's flag; no optimiser state)")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=True)
    p.add_argument("--clear-cache-threshold", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from engine.loader import ModelLoadError, load_model, resolve_model_path
    from engine.tokenizer import load_tokenizer

    from .data import DataError, load_data_dir
    from .trainer import TrainConfig, train

    try:
        model_dir = resolve_model_path(args.model)
        model, _config = load_model(model_dir)
        tok = load_tokenizer(model_dir)
    except (ModelLoadError, FileNotFoundError, ValueError) as e:
        print(f"engine-train: cannot load model: {e}", file=sys.stderr)
        return 2
    try:
        data = load_data_dir(args.data, tok, mask_prompt=args.mask_prompt)
    except (DataError, OSError) as e:
        print(f"engine-train: {e}", file=sys.stderr)
        return 2
    n_layers = len(model.layers)
    num_layers = args.num_layers
    if num_layers is None:
        num_layers = 16 if n_layers >= 16 else -1
    if num_layers > n_layers:
        print(f"engine-train: --num-layers {num_layers} but the model has {n_layers} blocks",
              file=sys.stderr)
        return 2
    head = args.loss_head or ("chunked" if args.segment_size else "full")
    cfg = TrainConfig(
        model=args.model, data=args.data, adapter_path=args.adapter_path, iters=args.iters,
        batch_size=args.batch_size, learning_rate=args.learning_rate, optimizer=args.optimizer,
        weight_decay=args.weight_decay, momentum=args.momentum, rank=args.rank,
        scale=args.scale, dropout=args.dropout, num_layers=num_layers,
        keys=args.lora_keys.split(",") if args.lora_keys else None,
        max_seq_length=args.max_seq_length, grad_accumulation=args.grad_accumulation,
        grad_checkpoint=args.grad_checkpoint, segment_size=args.segment_size,
        mlp_chunk=args.mlp_chunk, token_chunk=args.token_chunk, loss_head=head,
        chunk_size=args.chunk_size, val_batches=args.val_batches,
        steps_per_report=args.steps_per_report, steps_per_eval=args.steps_per_eval,
        save_every=args.save_every, seed=args.seed, mask_prompt=args.mask_prompt,
        compile=args.compile, resume=args.resume, resume_adapter_file=args.resume_adapter_file,
        clear_cache_threshold=args.clear_cache_threshold)
    train_set, valid_set = data["train"], data["valid"]
    if valid_set is None or len(valid_set) == 0:
        print("engine-train: no valid.jsonl; training without validation", file=sys.stderr)
        valid_set = None
    print(f"Loaded {len(train_set)} train / {0 if valid_set is None else len(valid_set)} valid "
          f"examples ({train_set.format} format, prompt masking "
          f"{'on' if args.mask_prompt else 'off'})")
    try:
        import engine
        meta = {"engine_version": engine.__version__}
        train(model, cfg, train_set, valid_set, meta=meta)
    except (ValueError, DataError, FileNotFoundError) as e:
        print(f"engine-train: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
