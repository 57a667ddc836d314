"""`engine-generate`: stream a completion and print speed and peak memory.

    engine-generate --model DIR --prompt "Hello" [--max-tokens N --temp T --top-p P
                    --top-k K --min-p M --seed S --system-prompt TEXT
                    --ignore-chat-template --extra-eos-token T ... --max-kv-size N
                    --prompt-cache-file F --verbose true|false --kv-bits B ...
                    --thinking true|false --memory-budget GB --adapter-path DIR
                    --tier l1|l2|l3 --[no-]compiled-decode --[no-]perf-kernel ...]

The flags, their defaults and what is printed are mlx_lm.generate's: the same command
prints the same completion (the chat template applied when the model has one; greedy
unless --temp is given; `--generation-config` takes unset sampling values from the
model's generation_config.json instead). The flags mean the same in engine-serve and
engine-train where they exist. The tier and lever flags (--tier, --compiled-decode, ...)
are this project's own (docs/l3.md).

Without --model it uses the built-in default model: a tiny random-weight
model built offline into the fixture cache (no download).
"""

from __future__ import annotations

import os
import sys

from .argparsing import (CliParser, DefaultsHelpFormatter, add_deterministic_flag, add_speculation_flags,
                          json_dict, parse_bool, speculation_settings)

# mlx_lm.generate's sampling defaults (it does not read generation_config.json)
MLX_LM_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0}
UNSUPPORTED = {
    "--quantize-activations": "activation quantization is not implemented",
    "-qa": "activation quantization is not implemented",
    "--use-default-chat-template": "use --chat-template-config, or the model's own template",
}


def default_model_dir() -> str:
    # The built-in default model is built offline by `starter` (random weights).
    from starter import default_model_dir as built_in
    return built_in()


def parser() -> CliParser:
    """Flags named like mlx_lm.generate's (the project's other names as aliases)."""
    p = CliParser(prog="engine-generate", description="Generate text with mlx-parity",
                  formatter_class=DefaultsHelpFormatter)
    a = p.add_argument
    a("--model", help="model directory or Hugging Face repo id (default: the built-in tiny "
      "model, or the one a --prompt-cache-file was made with)")
    a("--adapter-path", help="LoRA adapter directory (mlx-lm format)")
    a("--prompt", "-p", default="hello", help="prompt text ('-' reads stdin)")
    a("--system-prompt", "--system", dest="system_prompt", help="system message of the chat "
      "template")
    a("--image", nargs="+", action="extend", default=None, metavar="FILE",
      help="image file(s) for a model with a vision tower (docs/vision.md)")
    a("--prefill-response", help="start of the assistant's answer (continued by the model)")
    a("--ignore-chat-template", action="store_true",
      help="encode the prompt as-is instead of in the model's chat template")
    a("--chat", action="store_true", help="require the chat template (the default when the "
      "model has one)")
    a("--chat-template-config", "--chat-template-args", dest="chat_template_args",
      type=json_dict, default=None, metavar="JSON",
      help='JSON dict passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    a("--thinking", type=parse_bool, metavar="true|false", default=None,
      help="the template's enable_thinking")
    a("--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
      help="more tokens (text or id) that end the generation")
    a("--max-tokens", "-m", type=int, default=100, help="tokens to generate at most")
    a("--temp", "--temperature", dest="temperature", type=float, default=None,
      help="sampling temperature (default 0.0: greedy)")
    a("--top-p", type=float, default=None, help="top-p (default 1.0: off)")
    a("--top-k", type=int, default=None, help="top-k (default 0: off)")
    a("--min-p", type=float, default=None, help="min-p (default 0.0: off)")
    a("--min-tokens-to-keep", type=int, default=1, help="tokens min-p always keeps")
    a("--xtc-probability", type=float, default=0.0, help="XTC sampling probability")
    a("--xtc-threshold", type=float, default=0.1, help="XTC threshold")
    a("--generation-config", action="store_true",
      help="take unset sampling values from the model's generation_config.json (as "
      "engine-serve does) instead of mlx_lm.generate's defaults")
    a("--repetition-penalty", type=float, default=None)
    a("--seed", type=int, default=None, help="PRNG seed")
    a("--stop", action="append", default=None, help="stop string (repeatable)")
    a("--verbose", type=parse_bool, default=True, metavar="true|false",
      help="print the separators and the prompt/generation tok/s and peak memory lines "
      "(default true); false prints only the completion")
    add_speculation_flags(a)
    add_deterministic_flag(a)
    a("--max-kv-size", type=int, default=None, metavar="N",
      help="keep at most N tokens in each layer's cache (a ring that keeps the first 4), "
      "for models with only full-attention layers")
    a("--prompt-cache-file", metavar="FILE",
      help="a prompt cache saved by mlx_lm.cache_prompt (or engine.kv.cache_file): the prompt "
      "continues it")
    a("--trust-remote-code", action="store_true",
      help="accepted for mlx-lm compatibility (no model code is ever downloaded)")
    a("--tensor-parallel", action="store_true",
      help="shard the model over the ranks of an `mlx.launch` run")
    a("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
      help="quantize the KV cache to this many bits (default: not quantized)")
    a("--kv-group-size", type=int, default=64, choices=[32, 64, 128])
    a("--quantized-kv-start", type=int, default=5000,
      help="with --kv-bits, quantize the cache once it holds this many tokens")
    a("--kv-config", help="per-layer kv_config.json")
    a("--memory-budget", type=float, metavar="GB", default=None,
      help="refuse a prompt + max tokens that would not fit this many decimal GB "
           "(default: machine RAM x 0.75)")
    a("--prefill-step-size", type=int, default=2048, help="prefill chunk")
    p.unsupported(UNSUPPORTED)
    from engine.levers import add_lever_args   # L3 hook: tier presets and lever switches
    add_lever_args(p)
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


class CliError(Exception):
    """A one-line error for stderr (exit 2)."""


def _load_cache_file(args):
    """(caches, model path) from --prompt-cache-file, checked against the other flags."""
    from engine.kv.cache_file import CacheFileError, load_prompt_cache
    from engine.kv.cache import QuantizedKVCache

    try:
        caches, meta = load_prompt_cache(args.prompt_cache_file)
    except CacheFileError as e:
        raise CliError(str(e)) from None
    made_with = meta.get("model")
    if args.model is not None and made_with is not None and args.model != made_with:
        raise CliError(f"--model {args.model} is not the model the prompt cache was made "
                       f"with ({made_with})")
    if isinstance(caches[0], QuantizedKVCache):
        if args.kv_bits is not None and args.kv_bits != caches[0].bits:
            raise CliError("--kv-bits does not match the kv cache loaded from "
                           "--prompt-cache-file")
        if args.kv_group_size != caches[0].group_size:
            raise CliError("--kv-group-size does not match the kv cache loaded from "
                           "--prompt-cache-file")
    return caches, args.model or made_with


def prompt_text(args) -> str:
    """--prompt with its \\n and \\t escapes read ('-': stdin)."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if prompt == "-" else prompt


def prompt_ids(args, tok, using_cache: bool) -> list:
    """The prompt's token ids, built as mlx_lm.generate builds them."""
    from engine.step.request import PromptError

    prompt = prompt_text(args)
    use_template = args.chat or (not args.ignore_chat_template and tok.has_chat_template)
    if not use_template:
        return tok.encode(prompt, add_special_tokens=True)
    kwargs = dict(args.chat_template_args or {})
    if args.thinking is not None:
        kwargs["enable_thinking"] = args.thinking
    msgs = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    msgs.append({"role": "user", "content": prompt})
    prefill = args.prefill_response is not None
    if prefill:
        msgs.append({"role": "assistant", "content": args.prefill_response})
    opts = dict(tokenize=False, continue_final_message=prefill, add_generation_prompt=not prefill)
    try:
        text = tok.apply_chat_template(msgs, **opts, **kwargs)
        if using_cache:   # the cache holds the template up to the last message's text
            msgs[-1]["content"] = "<query>"
            text = text[tok.apply_chat_template(msgs, **opts).index("<query>"):]
    except Exception as e:      # a template error is the user's input problem
        raise PromptError(f"chat template failed: {e}") from None
    return tok.encode(text, add_special_tokens=False)


def image_prompt(args, model, tok, model_dir) -> tuple:
    """(ids, engine.vision.VisionInput) of the prompt with --image files after its text."""
    from engine.vision import has_vision, preprocessor_for, vision_prompt

    if args.prompt_cache_file or args.ignore_chat_template or args.prefill_response is not None:
        raise CliError("--image does not go with --prompt-cache-file, --ignore-chat-template "
                       "or --prefill-response")
    data = []
    for f in args.image:
        try:
            with open(f, "rb") as fh:
                data.append(fh.read())
        except OSError as e:
            raise CliError(f"--image {f}: {e.strerror or e}") from None
    prompt = prompt_text(args)
    msgs = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    msgs.append({"role": "user", "content": [{"type": "text", "text": prompt}]
                 + [{"type": "image"}] * len(data)})
    kwargs = dict(args.chat_template_args or {})
    if args.thinking is not None:
        kwargs["enable_thinking"] = args.thinking
    return vision_prompt(model, tok, msgs, data, template_kwargs=kwargs,
                         preprocess=preprocessor_for(model, model_dir) if has_vision(model)
                         else None)


def main(argv=None) -> int:
    args = parse_args(argv)
    import engine
    from engine.step.generation import PromptError
    from engine.kv.quant import KVConfigError
    from engine.levers import LeverError, levers_from_args
    from engine.loader import ModelLoadError

    try:
        levers = levers_from_args(args)
        lookup, draft_tokens = speculation_settings(args)
        if args.draft_model is not None and (args.tensor_parallel or args.kv_bits
                                             or args.kv_config or args.max_kv_size):
            raise CliError("--draft-model is not supported with --tensor-parallel, --kv-bits, "
                           "--kv-config or --max-kv-size")
        if args.deterministic:
            from engine.deterministic import why_not_deterministic
            if why_not_deterministic(levers):
                raise CliError(why_not_deterministic(levers))
        caches, model_path = (_load_cache_file(args) if args.prompt_cache_file
                              else (None, args.model))
    except (LeverError, CliError, ValueError) as e:
        print(f"engine-generate: {e}", file=sys.stderr)
        return 2
    out = sys.stdout
    seed = args.seed
    if seed is not None and not args.tensor_parallel:
        # mlx_lm.generate's order: seed first, then build the model (whose random init
        # draws advance the generator), then sample from the global generator
        import mlx.core as mx
        mx.random.seed(seed)
        seed = None
    if args.tensor_parallel:
        import mlx.core as mx
        from engine.distributed import agreed_seed
        if mx.distributed.init().rank() != 0:  # every rank computes, rank 0 prints
            out = open(os.devnull, "w")
        if seed is None:  # sampling ranks must draw the same tokens
            seed = agreed_seed()
    try:
        model, tok = engine.load(model_path or default_model_dir(),
                                 adapter_path=args.adapter_path,
                                 tensor_parallel=args.tensor_parallel)
    except (ModelLoadError, FileNotFoundError, ValueError) as e:
        print(f"engine-generate: cannot load model: {e}", file=sys.stderr)
        return 2
    if lookup and not args.deterministic:
        from engine.step.lookup import lookup_unsupported
        if lookup_unsupported(model):
            print(f"engine-generate: --prompt-lookup: {lookup_unsupported(model)}", file=sys.stderr)
            return 2
    draft = None
    if args.draft_model is not None:    # (loaded after the model, as mlx_lm.generate does)
        from engine.step.draft import load_draft
        try:
            draft = load_draft(args.draft_model, model, tok)
        except ValueError as e:         # (ModelLoadError and DraftModelError)
            print(f"engine-generate: --draft-model: {e}", file=sys.stderr)
            return 2
    sampling = {k: getattr(args, k) for k in MLX_LM_SAMPLING}
    if not args.generation_config:
        sampling = {k: MLX_LM_SAMPLING[k] if v is None else v for k, v in sampling.items()}
    from engine.step.admission import Admission
    budget = int(args.memory_budget * 1e9) if args.memory_budget else None
    admission = Admission.for_model(model, budget, prefill_step=args.prefill_step_size)
    if draft is not None:
        admission = admission.with_draft(draft)
    text, last, vision = "", None, None
    try:
        for t in args.extra_eos_token:
            tok.add_eos_token(t)
        if args.image:
            from engine.loader import resolve_model_path
            ids, vision = image_prompt(args, model, tok,
                                       resolve_model_path(model_path or default_model_dir()))
        else:
            ids = prompt_ids(args, tok, caches is not None)
        if args.verbose:
            print("=" * 10, file=out)
        for seg in engine.stream_generate(
                model, tok, ids, max_tokens=args.max_tokens, **sampling,
                min_tokens_to_keep=args.min_tokens_to_keep,
                xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                repetition_penalty=args.repetition_penalty, seed=seed, stop=args.stop,
                prompt_lookup=lookup, num_draft_tokens=draft_tokens, draft_model=draft,
                spec_sampling=args.spec_sampling,
                kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                quantized_kv_start=args.quantized_kv_start, kv_config=args.kv_config,
                admission=admission, prefill_step_size=args.prefill_step_size, levers=levers,
                prefix_caches=caches, max_kv_size=args.max_kv_size,
                deterministic=args.deterministic, vision=vision):
            if args.verbose:
                print(seg.text, end="", flush=True, file=out)
            text += seg.text
            last = seg
    except (PromptError, KVConfigError, ValueError, CliError) as e:   # (incl. over the budget)
        print(f"\nengine-generate: {e}", file=sys.stderr)
        return 2
    if not args.verbose:
        print(text, file=out)
        return 0
    print(file=out)
    print("=" * 10, file=out)
    if not text:
        print("No text generated for this prompt", file=out)
        return 0
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", file=out)
    print(f"Generation: {last.generation_tokens} tokens, "
          f"{last.generation_tps:.3f} tokens-per-sec", file=out)
    print(f"Peak memory: {last.peak_memory_gb:.3f} GB", file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
