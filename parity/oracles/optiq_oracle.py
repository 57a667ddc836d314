"""mlx-optiq 0.7.7 as the L2 oracle for quantized sliding-window KV.

mlx-lm refuses to quantize a RotatingKVCache. mlx-optiq's
`patch_rotating_to_quantized()` makes `RotatingKVCache.to_quantized` return
its `RotatingQuantizedKVCache` and makes mlx-lm's attention accept quantized
K/V handed across Gemma 4's KV-shared layers. The patch is process-wide and
touches mlx-lm only (never our engine); it changes nothing for float caches.
"""

from __future__ import annotations

# `import optiq` registers its own `mlx_lm.tool_parsers.minicpm5` (a parser
# that returns a list and raises on no call) in sys.modules unless mlx-lm's
# module is already there; the swap is process-wide and would turn mlx-lm's
# tool-parser oracle into optiq's for every later test. Importing mlx-lm's
# module first keeps the oracle mlx-lm's.
import mlx_lm.tool_parsers.minicpm5  # noqa: F401  (must precede `optiq`)

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


def mixed_kv_reference(model_dir, prompt, steps, kv_config, start=0):
    """mlx-optiq's mixed-precision KV over mlx-lm, run in a child process
    (see `parity.oracles.optiq_mixed`). Returns the loaded `.npz` dict."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "spec.json"
        spec.write_text(json.dumps({"model": str(model_dir), "prompt": list(prompt),
                                    "steps": steps, "kv_config": list(kv_config), "start": start}))
        out = Path(d) / "out.npz"
        root = Path(__file__).resolve().parents[2]
        r = subprocess.run([sys.executable, "-m", "parity.oracles.optiq_mixed", str(spec), str(out)],
                           cwd=root, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"optiq mixed-KV oracle failed:\n{r.stderr[-3000:]}")
        with np.load(out) as z:
            return {k: z[k] for k in z.files}
