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

__all__ = ["BUILTIN", "BUILTIN_PREFIX", "builtin_model_dir", "cache_root", "default_model_dir"]

BUILTIN_PREFIX = "builtin:"
# name -> (family, dtype, variant): `--model builtin:NAME` on every CLI
BUILTIN = {"default": ("qwen3", "bfloat16", ""),        # context 4,096 tokens
           "long": ("qwen3", "bfloat16", "long")}       # context 131,072 tokens


def default_model_dir() -> str:
    """The built-in default model (qwen3 layout, bf16), built on first use."""
    return builtin_model_dir("default")


def builtin_model_dir(name: str) -> str:
    """A built-in model by name (`default`, `long`; a `builtin:` prefix is allowed),
    built on first use. An unknown name is a ValueError naming the known ones."""
    from .models import ensure_fixture
    key = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    if key not in BUILTIN:
        raise ValueError(f"unknown built-in model {name!r}; have "
                         f"{', '.join(BUILTIN_PREFIX + k for k in BUILTIN)}")
    family, dtype, variant = BUILTIN[key]
    return str(ensure_fixture(family, dtype, variant=variant))
