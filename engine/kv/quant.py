"""KV-cache quantization policy: uniform (`kv_bits`) or per layer (`kv_config.json`).

A layer's cache is converted to its quantized form once it holds at least
`quantized_kv_start` tokens; the check runs after every forward (prefill chunk
or decode step), the same schedule mlx-lm's generation uses, so the prefill
itself attends to float K/V. Sliding-window layers become rotating quantized
caches (mlx-lm refuses these; mlx-optiq has them: that path is the L2 tier).

`kv_config.json` is a JSON list of `{"layer_idx": i, "bits": b, "group_size": g}`;
`layer_idx` indexes the model's cache list (for KV-sharing models, the layers
that own a cache). Layers without an entry stay unquantized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

VALID_BITS = (2, 3, 4, 5, 6, 8)
VALID_GROUPS = (32, 64, 128)


class KVConfigError(ValueError):
    """A kv_config / kv_bits setting that cannot apply to this model."""


@dataclass
class KVPolicy:
    layers: dict = field(default_factory=dict)  # cache index -> (bits, group_size)
    start: int = 0

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def apply(self, caches: list) -> None:
        """Convert, in place, every configured cache that has reached `start` tokens."""
        for i, (bits, group) in self.layers.items():
            c = caches[i]
            if c.bits or c.offset < self.start or c.keys is None:
                continue
            caches[i] = c.to_quantized(group_size=group, bits=bits)

    def describe(self) -> dict:
        counts: dict = {}
        for bits, group in self.layers.values():
            counts[f"{bits}/{group}"] = counts.get(f"{bits}/{group}", 0) + 1
        return {"quantized_layers": len(self.layers), "by_bits_group": counts,
                "quantized_kv_start": self.start}


def cache_head_dims(model) -> list[int]:
    """head_dim of each layer that owns a cache, in cache-list order."""
    caches = model.make_cache()
    dims = []
    for layer in model.layers[: len(caches)]:
        dims.append(layer.self_attn.head_dim)
    return dims


def _check(bits, group, head_dim, where):
    if bits not in VALID_BITS:
        raise KVConfigError(f"{where}: bits must be one of {VALID_BITS} (got {bits})")
    if group not in VALID_GROUPS:
        raise KVConfigError(f"{where}: group_size must be one of {VALID_GROUPS} (got {group})")
    if head_dim % group:
        raise KVConfigError(f"{where}: head_dim {head_dim} is not divisible by group_size {group}")


def load_kv_config(source: Union[str, Path, list]) -> list[dict]:
    if isinstance(source, (str, Path)):
        p = Path(source)
        try:
            source = json.loads(p.read_text())
        except FileNotFoundError:
            raise KVConfigError(f"kv_config file not found: {p}") from None
        except json.JSONDecodeError as e:
            raise KVConfigError(f"{p}: invalid JSON ({e})") from None
    if not isinstance(source, list):
        raise KVConfigError("kv_config must be a JSON list of {layer_idx, bits, group_size}")
    for i, e in enumerate(source):
        if not isinstance(e, dict) or "layer_idx" not in e or "bits" not in e:
            raise KVConfigError(f"kv_config entry {i} needs layer_idx and bits: {e!r}")
    return source


def make_policy(model, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                quantized_kv_start: int = 0, kv_config=None) -> KVPolicy:
    """The policy for a request; raises KVConfigError for settings that cannot apply."""
    if kv_bits is not None and kv_config is not None:
        raise KVConfigError("give kv_bits or kv_config, not both")
    if quantized_kv_start < 0:
        raise KVConfigError("quantized_kv_start must be >= 0")
    if kv_bits is None and kv_config is None:
        return KVPolicy({}, quantized_kv_start)
    dims = cache_head_dims(model)
    layers = {}
    if kv_bits is not None:
        for i, d in enumerate(dims):
            _check(kv_bits, kv_group_size, d, f"layer {i}")
            layers[i] = (kv_bits, kv_group_size)
    else:
        for e in load_kv_config(kv_config):
            i = e["layer_idx"]
            if not isinstance(i, int) or not 0 <= i < len(dims):
                raise KVConfigError(f"kv_config layer_idx {i!r} is out of range 0..{len(dims) - 1}")
            g = e.get("group_size", 64)
            _check(e["bits"], g, dims[i], f"kv_config layer {i}")
            layers[i] = (e["bits"], g)
    return KVPolicy(layers, quantized_kv_start)
