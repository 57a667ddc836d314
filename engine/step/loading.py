"""Building an `Engine` from a model directory (`Engine.load`): the weights (and a draft
model's), memory admission, the prompt cache in RAM and on disk, the adapter registry, and
tensor parallelism's coordination of the ranks."""

from __future__ import annotations

from typing import Optional


def load_engine(cls, path, *, max_batch: int = 1, adapter_path=None,
                memory_budget_bytes: Optional[int] = None, prompt_cache_bytes: Optional[int] = 0,
                tensor_parallel: bool = False, tp_timeout: Optional[float] = 60.0,
                prompt_cache_dir=None, prompt_cache_disk_gb: float = 20.0, draft_model=None,
                **kw):
    """An Engine of class `cls` for a model directory; memory admission on (budget: 75% of
    RAM by default).

    prompt_cache_bytes: the prompt cache's cap (0: none; None: what the server takes by
    default, `Admission.prompt_cache_bytes()`, a share of the budget left after the weights).
    `tensor_parallel=True` (under `mlx.launch`): every rank loads its shard (`engine.load`)
    and builds the same Engine (rank 0's memory budget). On rank 0 this returns an
    `engine.distributed.Leader` with the Engine's interface, which makes every call on every
    rank; the other ranks replay rank 0's calls until rank 0 closes it (or exits), then the
    process ends (`engine.distributed.coordinate`). `tp_timeout`: seconds a step may take on
    rank 0 before the ranks are given up (None: no limit). prompt_cache_dir: keep prefixes'
    KV as files there too, read back after a restart (`engine.kv.disk_cache`), at most
    `prompt_cache_disk_gb` GB (10^9 bytes). draft_model: a model directory or repo id
    drafting for speculative decoding (`engine.step.draft`; the same tokenizer vocabulary,
    else `DraftModelError`)."""
    from engine.adapters.registry import AdapterRegistry
    from engine.kv.prompt_cache import PromptCache
    from engine.loader import load, resolve_model_path
    from engine.step.admission import Admission, default_budget
    model, tokenizer = load(path, adapter_path=adapter_path, tensor_parallel=tensor_parallel)
    if draft_model is not None:
        from engine.step.draft import DraftModelError, load_draft
        if tensor_parallel:
            raise DraftModelError("a draft model is not supported with tensor_parallel")
        kw["draft_model"] = load_draft(draft_model, model, tokenizer)
    if tensor_parallel:
        from engine.distributed import sharding
        if memory_budget_bytes is None:     # every rank admits what rank 0 admits
            memory_budget_bytes = sharding.broadcast_json(default_budget())
    eng = cls(model, tokenizer, max_batch=max_batch, **kw)
    if getattr(model, "vision", None) is not None:
        from engine.vision import preprocessor_for
        eng.image_preprocess = preprocessor_for(model, resolve_model_path(path))
    eng.admission = Admission.for_model(model, memory_budget_bytes, eng.policy,
                                        prefill_step=eng.prefill_step_size)
    if eng.draft_model is not None:       # (its weights and KV count too)
        eng.admission = eng.admission.with_draft(eng.draft_model)
    if prompt_cache_bytes is None:
        prompt_cache_bytes = eng.admission.prompt_cache_bytes()
    eng.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None
    eng.adapters = AdapterRegistry(model, eng.prompt_cache)
    if prompt_cache_dir is not None:
        if tensor_parallel:
            raise ValueError("prompt_cache_dir is not supported with tensor_parallel=True")
        from engine.kv.disk_cache import disk_cache_for
        eng.disk_cache = disk_cache_for(prompt_cache_dir, prompt_cache_disk_gb,
                                        resolve_model_path(path), eng, adapter_path)
    if tensor_parallel:
        from engine.distributed import coordinate
        return coordinate(eng, tp_timeout)
    return eng
