"""Model directory (HF or MLX layout) or Hugging Face repo id -> model.

`resolve_model_path` turns a repo id (`org/name`) into a local snapshot
directory through `huggingface_hub` (the local hub cache first; a download
with a progress bar when the network is allowed; `HF_HUB_OFFLINE=1` stays
offline). `load_model` then reads `config.json`, one or many `model*.safetensors`
(an index file names the shards when present), applies the architecture's
`sanitize`, and rebuilds quantized layers from the `quantization` block mlx-lm
writes (per-layer overrides included: a path mapped to False stays float, a dict
sets its own bits/group size).
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .models import build


class ModelLoadError(ValueError):
    """The directory does not hold a model this engine can load."""


# What a snapshot download fetches: weights, configs, tokenizer and template files.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken",
                "*.jsonl"]


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return (0 < len(parts) <= 2 and all(parts) and not name.startswith((".", "~"))
            and "\\" not in name)


def resolve_model_path(path_or_id, revision: str | None = None, cache_dir=None) -> Path:
    """A local model directory for a directory path, a Hugging Face repo id, or a
    built-in tiny model (`builtin:default`, `builtin:long`: built offline on first use).

    An existing path is returned as is (it must be a directory). Anything else
    that looks like `org/name` is looked up with `huggingface_hub.snapshot_download`:
    the local hub cache (`HF_HUB_CACHE`, or `cache_dir`) answers when it holds the
    snapshot; otherwise the files are downloaded unless `HF_HUB_OFFLINE=1`."""
    if str(path_or_id).startswith("builtin:"):     # a built-in tiny model (starter)
        from starter import builtin_model_dir
        try:
            return Path(builtin_model_dir(str(path_or_id)))
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path}: not a directory")
        return path
    name = str(path_or_id)
    if not _looks_like_repo_id(name):
        raise ModelLoadError(f"{name}: no such directory")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    where = f"the Hugging Face cache {cache}"
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache,
                                      allow_patterns=HUB_PATTERNS))
    except HFValidationError:
        raise ModelLoadError(f"{name}: no such directory, and not a valid Hugging Face "
                             "repo id") from None
    except Exception as e:   # offline, unknown repo, network, auth: one line, no traceback
        offline = " (HF_HUB_OFFLINE=1: downloads are off)" if constants.HF_HUB_OFFLINE else ""
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{name}: not a local directory and not found in {where}"
                             f"{offline}; {type(e).__name__}: {reason}") from None


def read_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.exists():
        raise ModelLoadError(f"{path}: no config.json (is this a model directory?)")
    try:
        config = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{f}: not a JSON object")
    return config


def weight_files(path: Path) -> list[str]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise ModelLoadError(f"{path}: shards named in the index are missing: {missing}")
        return [str(path / s) for s in shards]
    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no model*.safetensors found")
    return files


def quantization_of(config: dict):
    q = config.get("quantization")
    if q is None:
        legacy = config.get("quantization_config") or config.get("text_config", {}).get(
            "quantization_config")
        if legacy and legacy.get("quant_method", "affine") in ("affine", "mlx") and "bits" in legacy:
            q = legacy
    return q


def apply_quantization(model: nn.Module, quant: dict, weights: dict):
    """Swap Linear/Embedding modules for quantized ones where the checkpoint has scales."""

    def predicate(path, module):
        if path in quant:
            return quant[path]
        if not hasattr(module, "to_quantized"):
            return False
        if f"{path}.scales" not in weights:
            return False
        # Infer this layer's bits from the packed width when the block is uniform.
        return {"group_size": quant["group_size"], "bits": quant["bits"],
                "mode": quant.get("mode", "affine")}

    nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                mode=quant.get("mode", "affine"), class_predicate=predicate)


def load_model(path, lazy: bool = False):
    path = resolve_model_path(path)
    config = read_config(path)
    weights = {}
    for f in weight_files(path):
        weights.update(mx.load(f))
    try:
        model = build(config)
    except (TypeError, KeyError) as e:
        raise ModelLoadError(f"{path}: config.json is missing a field the "
                             f"{config.get('model_type')!r} architecture needs ({e})") from None
    try:
        weights = model.sanitize(weights)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    quant = quantization_of(config)
    if quant is not None:
        apply_quantization(model, quant, weights)
    expected = dict(tree_flatten(model.parameters()))
    extra = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights))
    if extra or missing:
        raise ModelLoadError(
            f"{path}: weights do not match the {config.get('model_type')} architecture "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''})")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise ModelLoadError(f"{path}: {k} has shape {v.shape}, the config implies "
                                 f"{expected[k].shape}")
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model, config


def load(path, adapter_path=None, lazy: bool = False, tensor_parallel: bool = False):
    """(model, tokenizer) from an HF/MLX model directory or a Hugging Face repo id
    (`engine.load`; see `resolve_model_path`).

    `tensor_parallel=True` shards the model over the ranks of
    `mx.distributed.init()` (see `engine.distributed.sharding`); run it under `mlx.launch`.
    """
    from engine.text.tokenizer import load_tokenizer

    path = resolve_model_path(path)
    if tensor_parallel:
        if adapter_path is not None:
            raise ValueError("LoRA adapters are not supported with tensor_parallel=True")
        from .distributed.sharding import barrier, shard_model
        model, _config = load_model(path, lazy=True)
        shard_model(model)
        if not lazy:
            import mlx.core as mx
            mx.eval(model.parameters())
        barrier()
        return model, load_tokenizer(path)
    model, _config = load_model(path, lazy=lazy)
    if adapter_path is not None:
        from engine.adapters.mount import mount_adapter
        mount_adapter(model, adapter_path)
    return model, load_tokenizer(path)
