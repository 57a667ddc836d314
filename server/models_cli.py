"""`engine-serve` flags for several models (docs/models-serving.md).

    engine-serve --model DIR_A --model DIR_B [--models-dir DIR] [--models-memory-gb GB]
                 [--pin NAME ...] [--model-idle-ttl S]

One model (a single `--model`, or none): none of this applies and the server behaves
as it always has (the request's `model` field is ignored).
"""

from __future__ import annotations

from typing import Optional


def add_args(p) -> None:
    a = p.add_argument
    a("--models-dir", metavar="DIR",
      help="serve every model folder in DIR (a config.json and *.safetensors), named by the "
           "folder, beside any --model (repeat --model to serve several); a request's "
           "`model` picks one (docs/models-serving.md)")
    a("--models-memory-gb", type=float, metavar="GB",
      help="several models: one budget in decimal GB for the loaded models' weights, their "
           "prompt caches and the KV of their running requests; least recently used idle "
           "models are unloaded to fit (default: --memory-budget, else RAM x 0.75)")
    a("--pin", action="append", default=[], metavar="NAME",
      help="several models: load NAME at start and never unload it (repeatable)")
    a("--model-idle-ttl", type=float, metavar="SECONDS",
      help="several models: unload a model idle for SECONDS (never a pinned one; default: "
           "only to make room)")


def model_values(args) -> list:
    """The --model values (the flag repeats)."""
    m = args.model
    if m is None:
        return []
    return list(m) if isinstance(m, (list, tuple)) else [m]


def several(args) -> bool:
    return len(model_values(args)) > 1 or bool(getattr(args, "models_dir", None))


def refusal(args, config) -> Optional[str]:
    """Why these flags cannot serve several models (None: they can)."""
    if config.tensor_parallel:
        return "--tensor-parallel serves one model; leave out --models-dir and extra --model"
    if config.adapter:
        return ("--adapter is for one model; with several, mount adapters per model with "
                "POST /v1/adapters {\"model\": ...}")
    if args.model_id:
        return "--model-id names one model; with several, write --model NAME=DIR"
    if config.draft_model:
        return ("--draft-model drafts for one model (it must share that model's vocabulary); "
                "with several models leave it out")
    if args.models_memory_gb is not None and not args.models_memory_gb > 0:
        return "--models-memory-gb must be > 0"
    if args.model_idle_ttl is not None and not args.model_idle_ttl > 0:
        return "--model-idle-ttl must be > 0 (seconds)"
    return None


def pins_without(args) -> Optional[str]:
    """--pin / --models-memory-gb / --model-idle-ttl given while one model is served."""
    if several(args):
        return None
    used = [f for f, v in (("--pin", args.pin), ("--models-memory-gb", args.models_memory_gb),
                           ("--model-idle-ttl", args.model_idle_ttl)) if v]
    if used:
        return f"{', '.join(used)}: only with several models (--models-dir or --model twice)"
    return None


def budget_bytes(args, config) -> int:
    from engine import default_budget

    if args.models_memory_gb is not None:
        return int(args.models_memory_gb * 1e9)
    return config.memory_budget_bytes or default_budget()


def build(args, config):
    """The started `ModelPool` (pinned models loaded); raises ValueError with the reason."""
    from .models_catalog import ModelsConfigError, models_config
    from .models_pool import ModelPool

    try:
        models = models_config(model_values(args), args.models_dir, budget_bytes(args, config),
                               pins=args.pin, idle_ttl_s=args.model_idle_ttl)
    except ModelsConfigError as e:
        raise ValueError(str(e)) from None
    pool = ModelPool(config, models)
    try:
        return pool.start()
    except (MemoryError, RuntimeError) as e:
        pool.close()
        raise ValueError(str(e)) from None


def ready_line(pool, url: str) -> str:
    names = pool.names
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    pins = f"; pinned {', '.join(pool.models.pins)}" if pool.models.pins else ""
    ttl = f"; idle TTL {pool.models.idle_ttl_s:g} s" if pool.models.idle_ttl_s else ""
    auth = "on" if pool.config.api_key else "off"
    return (f"engine-serve ready: {url} models={shown} (default {pool.models.default.name}; "
            f"loaded on first use within {pool.budget_bytes / 1e9:.2f} GB{pins}{ttl}) "
            f"auth={auth}")
