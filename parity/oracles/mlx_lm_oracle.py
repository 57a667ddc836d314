"""mlx-lm 0.32.2 as the live L1 oracle.

Thin drivers only: load a directory with `mlx_lm.load`, make its caches with
mlx-lm's classes, and quantize them with mlx-lm's own
`maybe_quantize_kv_cache`, so the oracle side runs exactly the code an
mlx-lm user runs.
"""

from __future__ import annotations

import os
from functools import lru_cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

VERSION = mlx_lm.__version__


@lru_cache(maxsize=16)
def load(path: str):
    """(model, tokenizer) as `mlx_lm.load` gives them (cached per directory)."""
    return mlx_lm.load(str(path))


@lru_cache(maxsize=16)
def load_model(path: str):
    """The model alone, via the loader `mlx_lm.load` calls (`mlx_lm.utils.load_model`)."""
    from pathlib import Path
    from mlx_lm.utils import load_model as _load_model
    return _load_model(Path(path))[0]


def make_cache(model):
    return make_prompt_cache(model)


def quantizer(kv_bits=None, kv_group_size=64, quantized_kv_start=0):
    """The cache-conversion hook mlx-lm's generate_step runs after each forward."""
    def apply(caches):
        maybe_quantize_kv_cache(caches, quantized_kv_start, kv_group_size, kv_bits)
    return apply


def greedy_generate(model, prompt_ids, max_tokens, **kv):
    """Tokens and per-step logprobs from mlx-lm's own `generate_step` (greedy)."""
    out = []
    for tok, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, **kv):
        out.append((int(tok), logprobs))
    return out
