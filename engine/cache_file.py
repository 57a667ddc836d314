"""Prompt caches on disk, in mlx-lm's file format (`mlx_lm.cache_prompt`,
`mlx_lm.models.cache.save_prompt_cache`).

One `.safetensors` file: each layer's cache state as arrays (`"<layer>.<field>"`; a
quantized cache's keys and values are (packed, scales, biases) triples), with the
metadata (string keys) holding three lists: free-form metadata (`0.<key>`: mlx-lm
writes `model` and `tokenizer_config`), the class name of each layer's cache (`1.<i>`),
and which state entries were Python scalars, strings or None (`2.<j>`).

`load_prompt_cache(path)` returns (caches, metadata) with this engine's cache classes;
`save_prompt_cache(path, caches, metadata)` writes a file mlx-lm's loader reads.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .cache import KVCache, QuantizedKVCache, RotatingKVCache

# mlx-lm's class name -> (our class, the fields of its `state`, in order)
FIELDS = {
    "KVCache": (KVCache, ("keys", "values", "offset")),
    "RotatingKVCache": (RotatingKVCache, ("keys", "values", "offset", "keep", "max_size", "_idx")),
    "QuantizedKVCache": (QuantizedKVCache, ("keys", "values", "offset", "group_size", "bits")),
}


class CacheFileError(ValueError):
    """The file is not a prompt cache this engine can use."""


def _state(cache) -> tuple:
    name = type(cache).__name__
    if name not in FIELDS:
        raise CacheFileError(f"cannot save a {name} (saved: {', '.join(FIELDS)})")
    return name, tuple(getattr(cache, f) for f in FIELDS[name][1])


def save_prompt_cache(path, caches: list, metadata: dict | None = None) -> None:
    """Write `caches` (one per layer) and string `metadata` to `path` (.safetensors)."""
    names, states = zip(*(_state(c) for c in caches))
    scalars: list = [""]              # (never empty: tree_flatten would drop it)
    arrays = {}
    for key, v in tree_flatten(list(states)):
        if isinstance(v, mx.array):
            arrays[key] = v
        elif isinstance(v, (bool, int, float)):
            scalars.append((key, "scalar"))
            arrays[key] = mx.array(v)
        elif isinstance(v, str):
            scalars.append((key, "string"))
            arrays[key] = mx.array([ord(ch) for ch in v])
        elif v is None:
            scalars.append((key, "none"))
            arrays[key] = mx.array([])
        else:
            raise CacheFileError(f"cannot save a cache field of type {type(v).__name__}")
    # (a non-empty first list, or tree_unflatten would shift the other two)
    meta = dict(tree_flatten([{"saved_by": "mlx-parity", **(metadata or {})}, list(names),
                              scalars]))
    mx.save_safetensors(str(path), arrays, meta)


def load_prompt_cache(path) -> tuple[list, dict]:
    """(caches, metadata) from a file written by `save_prompt_cache` or mlx-lm."""
    p = Path(path)
    if not p.is_file():
        raise CacheFileError(f"{p} is not a file")
    try:
        arrays, raw = mx.load(str(p), return_metadata=True)
        metadata, names, scalars = tree_unflatten(list(raw.items()))
    except (ValueError, RuntimeError, TypeError) as e:
        raise CacheFileError(f"{p} is not a prompt cache file ({e})") from None
    for key, kind in scalars[1:]:
        a = arrays[key]
        arrays[key] = (a.item() if kind == "scalar" else
                       "".join(chr(i) for i in a.tolist()) if kind == "string" else None)
    states = tree_unflatten(list(arrays.items()))
    caches = []
    for name, state in zip(names, states):
        if name not in FIELDS:
            raise CacheFileError(f"{p}: cache type {name} is not supported "
                                 f"(supported: {', '.join(FIELDS)})")
        cls, fields = FIELDS[name]
        c = cls(0) if cls is RotatingKVCache else cls()
        for f, v in zip(fields, state):
            setattr(c, f, tuple(v) if isinstance(v, list) else v)
        caches.append(c)
    return caches, dict(metadata)
