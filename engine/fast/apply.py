"""From a `Levers` value to what the runners use: the fast step, if any.

`fast_step_for` is called once per batch scheduler (engine.step.core.Engine: the fast
runner's rows), `decoder_for` once per request the exact runner takes
(engine.step.core.Engine._start_solo); `prepare` applies the model-wide levers,
`merged_proj` and `force_wire`, once per model (Engine construction, and fast_step_for).

One `FastStep` per (model, levers) is kept on the model object, so its traced steps are
reused from one request to the next and by both runners.
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx

from ..levers import Levers
from .decode import FastDecoder, FastStep, why_not
from .merge import is_merged, merge_projections

log = logging.getLogger("engine.fast")
_ATTR = "_mlxp_fast_steps"
_WIRED = "_mlxp_wired"


def apply_force_wire(model, levers: Levers) -> bool:
    """Wire the weights (Metal only). Returns whether anything was done."""
    if not levers.force_wire:
        return False
    try:
        if not mx.metal.is_available():
            return False
    except AttributeError:
        return False
    from mlx.utils import tree_flatten
    size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    mx.set_wired_limit(size)
    return True


def prepare(model, levers: Optional[Levers]) -> None:
    """Model-wide levers, once per model (engine.step.core.Engine at construction): merged_proj
    (q/k/v and gate/up merged in place, so both lanes' prompt processing and decode use
    them; groups carrying an adapter stay separate) and force_wire."""
    if levers is None:
        return
    if levers.merged_proj and not is_merged(model):
        merge_projections(model)
    if levers.force_wire and not getattr(model, _WIRED, False):
        object.__setattr__(model, _WIRED, apply_force_wire(model, levers) or "n/a")


def fast_step_for(model, levers: Optional[Levers], policy=None) -> Optional[FastStep]:
    """The fast runner's step for this model and levers (one per pair, kept on the model so
    its traces serve every request and both runners), or None where decode stays on L1
    (levers off, or a model the fast step does not cover: logged once)."""
    if levers is None:
        return None
    prepare(model, levers)
    if not levers.fast_decode:
        return None
    if levers.fast.deterministic:   # (issue #41, GPU part: batch-invariant kernels go here)
        raise NotImplementedError("the fast runner has no batch-invariant (deterministic) "
                                  "kernels yet")
    reason = why_not(model, None, policy)
    if reason:
        log.info("fast decode not used: %s", reason)
        return None
    store = getattr(model, _ATTR, None)
    if store is None:
        store = {}
        object.__setattr__(model, _ATTR, store)
    step = store.get(levers)
    if step is None:
        step = store[levers] = FastStep(model, levers)
    return step


def decoder_for(model, levers: Optional[Levers], caches=None, policy=None) -> Optional[FastDecoder]:
    """The fast decode for one request's own caches (a request the exact runner takes), or
    None where it stays on L1 (also caches the step does not cover: logged)."""
    step = fast_step_for(model, levers, policy)
    if step is None:
        return None
    reason = why_not(model, caches, policy)
    if reason:
        log.info("fast decode not used: %s", reason)
        return None
    return FastDecoder(step)


def describe(levers: Optional[Levers], model=None) -> dict:
    """Tier and levers in force, for /stats and benchmark reports."""
    out = (levers or Levers()).as_dict()
    if model is not None and levers is not None and levers.fast_decode:
        reason = why_not(model)
        out["fast_decode"] = reason is None
        if reason:
            out["fast_decode_reason"] = reason
        step = (getattr(model, _ATTR, {}) or {}).get(levers)
        if step is not None:
            out["fast_stats"] = dict(vars(step.stats))
    return out
