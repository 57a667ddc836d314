"""`engine-generate`: stream a completion and print speed and peak memory.

    engine-generate --model DIR --prompt "Hello" [--max-tokens N --temp T --top-p P
                    --top-k K --min-p M --seed S --kv-bits B --kv-group-size G
                    --quantized-kv-start N --kv-config FILE --chat --system TEXT
                    --thinking true|false --memory-budget GB --adapter-path DIR
                    --tier l1|l2|l3 --[no-]compiled-decode --[no-]perf-kernel ...]

The flags are mlx_lm.generate's, shared with engine-serve and engine-train where they
mean the same thing (--model, --adapter-path, --temp/--temperature, --top-p, --max-tokens,
--kv-bits, --chat-template-args, --thinking, --memory-budget, --seed). The tier and
lever flags (--tier, --compiled-decode, ...) are this project's own (docs/l3.md).

Without --model it uses the built-in default model: a tiny random-weight
model built offline into the fixture cache (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def default_model_dir() -> str:
    # The built-in default model is built offline by `starter` (random weights).
    from starter import default_model_dir as built_in
    return built_in()


def parse_bool(v: str) -> bool:
    """argparse type for true|false flags (shared by the project's CLIs)."""
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def parser() -> argparse.ArgumentParser:
    """Flags named like mlx_lm.generate's (the project's other names as aliases)."""
    p = argparse.ArgumentParser(prog="engine-generate", description="Generate text with mlx-parity")
    p.add_argument("--model", help="model directory or Hugging Face repo id (default: the "
                   "built-in tiny model)")
    p.add_argument("--adapter-path", help="LoRA adapter directory (mlx-lm format)")
    p.add_argument("--prompt", "-p", default="hello", help="prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-tokens", "-m", type=int, default=100)
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="shard the model over the ranks of an `mlx.launch` run")
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8])
    p.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--quantized-kv-start", type=int, default=0)
    p.add_argument("--kv-config", help="per-layer kv_config.json")
    p.add_argument("--chat-template-args", type=json.loads, default=None,
                   help='JSON dict passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--thinking", type=parse_bool, metavar="true|false", default=None,
                   help="the template's enable_thinking (with --chat)")
    p.add_argument("--memory-budget", type=float, metavar="GB", default=None,
                   help="refuse a prompt + max tokens that would not fit this many decimal GB "
                        "(default: machine RAM x 0.75)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prefill chunk (2048)")
    from engine.levers import add_lever_args   # L3 hook: tier presets and lever switches
    add_lever_args(p)
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import engine
    from engine.generation import PromptError
    from engine.kv_quant import KVConfigError
    from engine.levers import LeverError, levers_from_args
    from engine.loader import ModelLoadError

    try:
        levers = levers_from_args(args)
    except LeverError as e:
        print(f"engine-generate: {e}", file=sys.stderr)
        return 2
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    out = sys.stdout
    if args.tensor_parallel:
        import mlx.core as mx
        from engine.distributed import agreed_seed
        if mx.distributed.init().rank() != 0:  # every rank computes, rank 0 prints
            out = open(os.devnull, "w")
        if args.seed is None:  # sampling ranks must draw the same tokens
            args.seed = agreed_seed()
    try:
        model, tok = engine.load(args.model or default_model_dir(), adapter_path=args.adapter_path,
                                 tensor_parallel=args.tensor_parallel)
    except (ModelLoadError, FileNotFoundError, ValueError) as e:
        print(f"engine-generate: cannot load model: {e}", file=sys.stderr)
        return 2
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = msgs + [{"role": "user", "content": prompt}]
    template_kwargs = dict(args.chat_template_args or {})
    if args.thinking is not None:
        template_kwargs["enable_thinking"] = args.thinking
    from engine.admission import Admission
    budget = int(args.memory_budget * 1e9) if args.memory_budget else None
    admission = Admission.for_model(model, budget, prefill_step=args.prefill_step_size)
    last = None
    try:
        for seg in engine.stream_generate(
                model, tok, prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
                kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                quantized_kv_start=args.quantized_kv_start, kv_config=args.kv_config,
                template_kwargs=template_kwargs, admission=admission,
                prefill_step_size=args.prefill_step_size, levers=levers):
            print(seg.text, end="", flush=True, file=out)
            last = seg
    except (PromptError, KVConfigError, ValueError) as e:      # (incl. over the memory budget)
        print(f"\nengine-generate: {e}", file=sys.stderr)
        return 2
    print(file=out)
    print("=" * 10, file=out)
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", file=out)
    print(f"Generation: {last.generation_tokens} tokens, "
          f"{last.generation_tps:.3f} tokens-per-sec", file=out)
    print(f"Peak memory: {last.peak_memory_gb:.3f} GB", file=out)
    print(f"Finish reason: {last.finish_reason}", file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
