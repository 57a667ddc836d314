"""mlx-parity engine: our own model code on MLX, proved bit-exact against mlx-lm.

The public API is what this module exports (``__all__``); the server imports nothing else.
The package is grouped by concern:

- ``engine.step``: ``Engine.step`` -- the scheduler, the lanes (mlx-lm's loop, the batch), requests,
  sampling, memory admission;
- ``engine.kv``: KV caches (float, quantized, batched), the prompt cache, cache files;
- ``engine.text``: tokenizer, detokenizer, chat template, stop strings, reasoning, tool calls;
- ``engine.constrained``: grammars for structured outputs and forced tool calls;
- ``engine.adapters``: LoRA layers, mounting adapters at inference time, the registry;
- ``engine.models``: one file per ``model_type``;
- ``engine.fast``: the L3 fast path (CUDA kernels under ``engine/fast/cuda``) and its config;
- ``engine.distributed``: tensor parallelism (sharding, the step broadcast, followers);
- ``engine.embeddings``: text embeddings (pooled final hidden states);
- ``engine.vision``: images in prompts (decoding, each vision family's preprocessing:
  Gemma 3, Qwen2.5-VL);
- ``engine.loader``, ``engine.convert``, ``engine.levers``, ``engine.cli``: loading, converting,
  the speed levers, the command line.
"""

from __future__ import annotations

__version__ = "0.6.5"

from .loader import load  # noqa: E402
from .step.core import Engine  # noqa: E402
from .step.request import RequestOutput, SamplingParams  # noqa: E402

__all__ = ["Engine", "RequestOutput", "SamplingParams", "generate", "load", "make_cache",
           "stream_generate"]


def make_cache(model, kv_bits=None, kv_group_size: int = 64):
    from .kv.cache import make_cache as _make

    return _make(model, kv_bits=kv_bits, kv_group_size=kv_group_size)


def stream_generate(model, tokenizer, prompt, **opts):
    """Yield `RequestOutput`s of new text; see `engine.step.generation.stream_generate`."""
    from .step.generation import stream_generate as _stream
    return _stream(model, tokenizer, prompt, **opts)


def generate(model, tokenizer, prompt, **opts):
    """The whole completion as a `GenerationResult`; see `engine.step.generation.generate`."""
    from .step.generation import generate as _generate
    return _generate(model, tokenizer, prompt, **opts)


# --- public API (lazy) ---
# The rest of the public API, imported on first use (PEP 562) so `import engine` stays light.
_LAZY = {
    # engine.adapters.registry
    "AdapterRegistry": "engine.adapters.registry",
    "AdapterRequestError": "engine.adapters.registry",
    # engine.argparsing
    "CliParser": "engine.argparsing",
    "add_deterministic_flag": "engine.argparsing",
    "add_speculation_flags": "engine.argparsing",
    "json_dict": "engine.argparsing",
    "parse_bool": "engine.argparsing",
    "speculation_settings": "engine.argparsing",
    "default_draft_tier": "engine.argparsing",
    # engine.cli
    "default_model_dir": "engine.cli",
    # engine.constrained
    "ConstraintError": "engine.constrained",
    "GrammarDeadEnd": "engine.constrained",
    "parse_response_format": "engine.constrained",
    "parse_tool_choice": "engine.constrained",
    "response_format_factory": "engine.constrained",
    "tool_choice_factory": "engine.constrained",
    # engine.constrained.checks
    "DEFAULT_MAX_SCHEMA_NODES": "engine.constrained.checks",
    "check_json_schema": "engine.constrained.checks",
    "check_tool_names": "engine.constrained.checks",
    "schema_nodes": "engine.constrained.checks",
    # engine.deterministic
    "DeterministicUnsupported": "engine.deterministic",
    "why_not_deterministic": "engine.deterministic",
    # engine.distributed
    "DEFAULT_TIMEOUT_S": "engine.distributed",
    "EXIT_RANK_LOST": "engine.distributed",
    "SHUTDOWN_GRACE_S": "engine.distributed",
    # engine.embeddings
    "EmbeddingInputError": "engine.embeddings",
    "EmbedJob": "engine.embeddings",
    "POOLINGS": "engine.embeddings",
    "checkpoint_pooling": "engine.embeddings",
    "embed": "engine.embeddings",
    # engine.fast.apply
    "describe": "engine.fast.apply",
    # engine.vision
    "ImageError": "engine.vision",
    "VisionInput": "engine.vision",
    "has_vision": "engine.vision",
    "preprocessor_for": "engine.vision",
    "image_formats": "engine.vision",
    # engine.kv.disk_cache
    "DiskCache": "engine.kv.disk_cache",
    "disk_cache_for": "engine.kv.disk_cache",
    "claim_cache_dir": "engine.kv.disk_dir",
    # engine.kv.prompt_cache
    "PromptCache": "engine.kv.prompt_cache",
    # engine.kv.quant
    "KVConfigError": "engine.kv.quant",
    "VALID_BITS": "engine.kv.quant",
    "cache_head_dims": "engine.kv.quant",
    "make_policy": "engine.kv.quant",
    # engine.levers
    "LeverError": "engine.levers",
    "add_lever_args": "engine.levers",
    "for_tier": "engine.levers",
    "levers_from_args": "engine.levers",
    # engine.loader
    "ModelLoadError": "engine.loader",
    "resolve_model_path": "engine.loader",
    # engine.step.admission
    "Admission": "engine.step.admission",
    "ContextOverBudget": "engine.step.admission",
    "default_budget": "engine.step.admission",
    # engine.step.draft
    "DraftModelError": "engine.step.draft",
    "load_draft": "engine.step.draft",
    "lookup_unsupported": "engine.step.lookup",
    "warm_up": "engine.step.warmup",
    # engine.step.request
    "ContextLengthExceeded": "engine.step.request",
    "PromptError": "engine.step.request",
    "RANGES": "engine.step.request",
    "SEED_MAX": "engine.step.request",
    "check_token_ids": "engine.step.request",
    "client_error": "engine.step.request",
    "encode_prompt": "engine.step.request",
    # engine.text.chat_template
    "check_chat_template": "engine.text.chat_template",
    # engine.text.reasoning
    "ChatOutputParser": "engine.text.reasoning",
    "ReasoningDelta": "engine.text.reasoning",
    "default_enable_thinking": "engine.text.reasoning",
    "reasoning_format_for": "engine.text.reasoning",
    "starts_in_reasoning": "engine.text.reasoning",
    # engine.text.tools
    "tool_format_for": "engine.text.tools",
}
# subpackages used whole (the server's tensor-parallel serving drives engine.distributed)
_PACKAGES = ("distributed",)
__all__ += sorted(_LAZY) + list(_PACKAGES)


def __getattr__(name):
    import importlib
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _PACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
# --- end public API ---
