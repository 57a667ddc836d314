"""Where the built-in models are cached."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where built models and tokenizers are cached."""
    env = os.environ.get("MLXP_FIXTURE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mlx-parity" / "builtin"
