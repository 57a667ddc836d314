"""mlx-parity engine: our own model code on MLX, proved bit-exact against mlx-lm."""

from __future__ import annotations

__version__ = "0.1.0"


def load(path, adapter_path=None, lazy: bool = False):
    """(model, tokenizer) from an HF/MLX model directory."""
    from .loader import load_model
    from .tokenizer import load_tokenizer

    model, _config = load_model(path, lazy=lazy)
    if adapter_path is not None:
        from .lora import mount_adapter
        mount_adapter(model, adapter_path)
    return model, load_tokenizer(path)


def make_cache(model, kv_bits=None, kv_group_size: int = 64):
    from .cache import make_cache as _make

    return _make(model, kv_bits=kv_bits, kv_group_size=kv_group_size)


def __getattr__(name):
    # generate / stream_generate live in engine.generate (imported on first use)
    if name in ("generate", "stream_generate"):
        from . import generate as _g
        return getattr(_g, name)
    raise AttributeError(name)
