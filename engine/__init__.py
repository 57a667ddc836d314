"""mlx-parity engine: our own model code on MLX, proved bit-exact against mlx-lm."""

from __future__ import annotations

__version__ = "0.2.0"


def load(path, adapter_path=None, lazy: bool = False):
    """(model, tokenizer) from an HF/MLX model directory or a Hugging Face repo id."""
    from .loader import load_model, resolve_model_path
    from .tokenizer import load_tokenizer

    path = resolve_model_path(path)
    model, _config = load_model(path, lazy=lazy)
    if adapter_path is not None:
        from .lora import mount_adapter
        mount_adapter(model, adapter_path)
    return model, load_tokenizer(path)


def make_cache(model, kv_bits=None, kv_group_size: int = 64):
    from .cache import make_cache as _make

    return _make(model, kv_bits=kv_bits, kv_group_size=kv_group_size)


def stream_generate(model, tokenizer, prompt, **opts):
    """Yield `Segment`s of new text; see `engine.generation.stream_generate`."""
    from .generation import stream_generate as _stream
    return _stream(model, tokenizer, prompt, **opts)


def generate(model, tokenizer, prompt, **opts):
    """The whole completion as a `GenerationResult`; see `engine.generation.generate`."""
    from .generation import generate as _generate
    return _generate(model, tokenizer, prompt, **opts)
