"""mlx-parity engine: our own model code on MLX, proved bit-exact against mlx-lm."""

from __future__ import annotations

__version__ = "0.2.10"

from .core import Engine  # noqa: E402
from .loader import load  # noqa: E402
from .request import RequestOutput, SamplingParams  # noqa: E402

__all__ = ["Engine", "RequestOutput", "SamplingParams", "generate", "load", "make_cache",
           "stream_generate"]


def make_cache(model, kv_bits=None, kv_group_size: int = 64):
    from .cache import make_cache as _make

    return _make(model, kv_bits=kv_bits, kv_group_size=kv_group_size)


def stream_generate(model, tokenizer, prompt, **opts):
    """Yield `RequestOutput`s of new text; see `engine.generation.stream_generate`."""
    from .generation import stream_generate as _stream
    return _stream(model, tokenizer, prompt, **opts)


def generate(model, tokenizer, prompt, **opts):
    """The whole completion as a `GenerationResult`; see `engine.generation.generate`."""
    from .generation import generate as _generate
    return _generate(model, tokenizer, prompt, **opts)
