"""Built-in tiny models, made offline.

`starter` builds small random-weight checkpoints laid out like real ones
(config.json, safetensors, a locally trained tokenizer with the family's chat
template). The server and the CLIs use one of them as the built-in default model
(it proves the plumbing; it knows nothing), and the parity tests use all of
them as fixtures. Built directories are cached under `$MLXP_FIXTURE_DIR`, else
`$XDG_CACHE_HOME/mlx-parity/builtin` (default `~/.cache/mlx-parity/builtin`).
"""

from __future__ import annotations

from .paths import cache_root

__all__ = ["cache_root", "default_model_dir"]


def default_model_dir() -> str:
    """The built-in default model (qwen3 layout, bf16), built on first use."""
    from .models import ensure_fixture
    return str(ensure_fixture("qwen3", "bfloat16"))
