"""The models one server may serve (`--model A --model B ...`, `--models-dir DIR`).

    config = models_config(["DIR_A", "NAME=DIR_B"], models_dir="DIR", budget_bytes=...)

`ModelsConfig` (pydantic, checked at start) lists a `ModelEntry` per model: its name
(what a request's `model` field says), its directory, its trained context and an
estimate of its weight bytes (the sizes of its `*.safetensors` files, known before
loading). Names are only ever looked up in this list: a request's `model` field is
never joined to a path.

A `--model` value is a directory (named by its last component), a Hugging Face repo id
or `builtin:NAME` (named by the value itself), or `NAME=WHERE`. In `--models-dir`,
each subfolder that holds a `config.json` and weights (`*.safetensors`) is a model
named by the folder; other entries (files, hidden folders, folders without weights)
are skipped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

log = logging.getLogger("engine-serve")

MAX_MODELS = 10_000             # a --models-dir with more entries is refused at start
MAX_CONFIG_BYTES = 4 << 20      # a config.json larger than this is not read
DEFAULT_PROMPT_CACHE_SHARE = 0.05   # per model, of the pool's budget (0 disables)


class ModelsConfigError(ValueError):
    """The model flags do not describe a servable set (the server does not start)."""


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=512)
    path: str = Field(min_length=1)
    context_length: Optional[int] = None      # max_position_embeddings (None: unknown)
    model_type: Optional[str] = None
    weights_bytes: int = Field(0, ge=0)        # the *.safetensors files' sizes


class ModelsConfig(BaseModel):
    """Several models under one memory budget (see server/models_pool.py)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    models: tuple[ModelEntry, ...] = Field(min_length=1, max_length=MAX_MODELS)
    memory_budget_bytes: int = Field(gt=0)
    pins: tuple[str, ...] = ()
    idle_ttl_s: Optional[float] = Field(None, gt=0)
    prompt_cache_share: float = Field(DEFAULT_PROMPT_CACHE_SHARE, ge=0, le=1)
    _by_name: dict = PrivateAttr(default_factory=dict)

    def model_post_init(self, _context) -> None:
        self._by_name = {e.name: e for e in self.models}

    @model_validator(mode="after")
    def _names(self):
        seen: dict = {}
        for e in self.models:
            if e.name in seen:
                raise ValueError(f"two models are named {e.name!r} ({seen[e.name]} and "
                                 f"{e.path}); name one with --model NAME=DIR")
            seen[e.name] = e.path
        for p in self.pins:
            if p not in seen:
                raise ValueError(f"--pin {p!r}: no such model (models: "
                                 f"{', '.join(list(seen)[:20])})")
        return self

    def entry(self, name) -> Optional[ModelEntry]:
        if not isinstance(name, str):
            return None
        return self._by_name.get(name)

    @property
    def default(self) -> ModelEntry:
        """The model a request without a `model` field gets: the first one listed."""
        return self.models[0]


def read_config(model_dir: Path) -> dict:
    f = model_dir / "config.json"
    try:
        if f.stat().st_size > MAX_CONFIG_BYTES:
            return {}
        cfg = json.loads(f.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def weights_bytes(model_dir: Path) -> int:
    total = 0
    for f in model_dir.glob("*.safetensors"):
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


def has_weights(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))


def entry_for(name: str, model_dir: Path) -> ModelEntry:
    cfg = read_config(model_dir)
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    ctx = cfg.get("max_position_embeddings") or tc.get("max_position_embeddings")
    mtype = cfg.get("model_type")
    return ModelEntry(name=name, path=str(model_dir),
                      context_length=ctx if isinstance(ctx, int) and ctx > 0 else None,
                      model_type=mtype if isinstance(mtype, str) else None,
                      weights_bytes=weights_bytes(model_dir))


def _split(value: str) -> tuple:
    """`NAME=WHERE` -> (NAME, WHERE); a plain value -> (None, value)."""
    if "=" in value and not Path(value).expanduser().exists():
        name, where = value.split("=", 1)
        if name and where:
            return name, where
    return None, value


def resolve(value: str) -> tuple:
    """(name, directory) of one --model value (a Hugging Face id is fetched, as today)."""
    from engine import resolve_model_path

    name, where = _split(value)
    local = Path(where).expanduser()
    model_dir = resolve_model_path(where)
    if name is None:
        name = local.resolve().name if local.exists() else where
    return name, Path(model_dir)


def scan_dir(models_dir: str) -> list:
    """(name, directory) of each model folder in `models_dir`, sorted by name."""
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise ModelsConfigError(f"--models-dir {models_dir}: not a directory")
    out = []
    try:
        children = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError as e:
        raise ModelsConfigError(f"--models-dir {models_dir}: {e}") from None
    for child in children:
        if child.name.startswith("."):
            continue
        if len(out) >= MAX_MODELS:
            raise ModelsConfigError(f"--models-dir {models_dir}: more than {MAX_MODELS} "
                                    "models")
        if child.is_dir() and has_weights(child) and read_config(child).get("model_type"):
            out.append((child.name, child))
        elif child.is_dir():
            log.info("--models-dir: %s skipped (no config.json naming a model_type, or no "
                     "*.safetensors)", child.name)
    return out


def models_config(models: list, models_dir: Optional[str], budget_bytes: int,
                  pins=(), idle_ttl_s: Optional[float] = None,
                  prompt_cache_share: float = DEFAULT_PROMPT_CACHE_SHARE) -> ModelsConfig:
    """The checked `ModelsConfig` of the flags; raises ModelsConfigError with the reason."""
    from engine import ModelLoadError

    found = []
    try:
        for value in models or ():
            found.append(resolve(str(value)))
    except ModelLoadError as e:
        raise ModelsConfigError(getattr(e, "message", None) or str(e)) from None
    if models_dir:
        found.extend(scan_dir(models_dir))
    if not found:
        raise ModelsConfigError(f"--models-dir {models_dir}: no model folders (each needs a "
                                "config.json and *.safetensors)")
    try:
        return ModelsConfig(models=tuple(entry_for(n, d) for n, d in found),
                            memory_budget_bytes=budget_bytes, pins=tuple(pins or ()),
                            idle_ttl_s=idle_ttl_s, prompt_cache_share=prompt_cache_share)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        msg = first.get("msg", "invalid")
        raise ModelsConfigError(f"{where + ': ' if where else ''}{msg}") from None
