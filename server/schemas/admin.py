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
    server: dict[str, Any]
    prompt_cache: dict[str, Any]
    admission: dict[str, Any]
    queue: dict[str, Any]
    batch: Optional[dict[str, Any]] = None
