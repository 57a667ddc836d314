"""mlx-optiq 0.7.7 as the L2 oracle for quantized sliding-window KV.

mlx-lm refuses to quantize a RotatingKVCache. mlx-optiq's
`patch_rotating_to_quantized()` makes `RotatingKVCache.to_quantized` return
its `RotatingQuantizedKVCache` and makes mlx-lm's attention accept quantized
K/V handed across Gemma 4's KV-shared layers. The patch is process-wide and
touches mlx-lm only (never our engine); it changes nothing for float caches.
"""

from __future__ import annotations

from optiq.runtime.kv import RotatingQuantizedKVCache, patch_rotating_to_quantized

try:
    from importlib.metadata import version as _v
    VERSION = _v("mlx-optiq")
except Exception:  # pragma: no cover
    VERSION = "unknown"

_installed = False


def install():
    global _installed
    patch_rotating_to_quantized()
    _installed = True


__all__ = ["RotatingQuantizedKVCache", "install", "VERSION"]
