"""Admin routes: models, adapters, stats, health (request and response models)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field

from .common import Body, Out


class AdapterMount(Body):
    """POST /v1/adapters. (`path` is required; the handler's 400 for a missing or empty
    one says what the directory must hold.)"""

    model_config = ConfigDict(json_schema_extra={"required": ["path"]})

    path: Optional[str] = Field(None, description=(
        "The adapter directory (adapters.safetensors + adapter_config.json), under one of "
        "the --adapter-dir roots."), json_schema_extra={"minLength": 1})
    id: Optional[str] = Field(None, description=(
        "The id requests select it by (default: the directory's name); no '+', ',', ' ', "
        "'/'; not \"none\" or \"base\"."))
    scale: Optional[float] = Field(None, description=(
        "LoRA scale (default: the adapter config's)."))
    model: Optional[str] = Field(None, description=(
        "Several models served: the model to mount it on (default: the first one; "
        "unmounted when that model is unloaded). One model: ignored."))


class Mounted(Out):
    id: str
    path: str
    mounted_layers: int
    rank: int
    scale: float
    size_bytes: int


class Unmounted(Out):
    id: str
    removed_layers: int


class AdapterList(Out):
    object: Literal["list"]
    adapters: list[dict[str, Any]]
    default: list[str] = Field(description="Adapters a request without `adapter` uses.")


class ModelCard(Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_length: Optional[int] = Field(None, description="The model's trained context.")
    max_model_len: Optional[int] = None
    context_window: Optional[int] = Field(None, description=(
        "The longest context memory admission accepts."))
    model_type: Optional[str] = None


class ModelList(Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Out):
    status: Literal["ok"]


class Index(Out):
    object: Literal["list"]
    endpoints: list[str]


class Stats(Out):
    """One model: its counters. Several models (docs/models-serving.md): `server`,
    `models` (the budget, the resident models, loads and evictions), `loaded` (each
    resident model's own counters, in the one-model shape) and `response_store`."""
    server: dict[str, Any]
    prompt_cache: Optional[dict[str, Any]] = None
    admission: Optional[dict[str, Any]] = None
    queue: Optional[dict[str, Any]] = None
    batch: Optional[dict[str, Any]] = None
    models: Optional[dict[str, Any]] = Field(None, description=(
        "Several models: the memory budget, resident/loading/pinned models, loads, "
        "evictions, refusals, and per model its weights, reserved KV and requests."))
    loaded: Optional[dict[str, Any]] = None
