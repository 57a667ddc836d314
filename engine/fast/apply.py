"""From a `Levers` value to what the token loop uses: the fast decoder, if any.

`decoder_for` is called once per solo-lane request (engine.step.core.Engine._start_solo);
`batch_decoder_for` once per batch scheduler (engine.step.core.Engine, with `fast_batch`);
`prepare` applies the model-wide levers, `merged_proj` and `force_wire`, once per model
(Engine construction, and decoder_for).

One `FastDecoder` (and one `FastBatchDecoder`) per (model, levers) is kept on the model
object, so its traced steps are reused from one request to the next.
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx

from ..levers import Levers
from .batch_decode import FastBatchDecoder
from .decode import FastDecoder, why_not
from .merge import is_merged, merge_projections

log = logging.getLogger("engine.fast")
_ATTR = "_mlxp_fast_decoders"
_BATCH_ATTR = "_mlxp_fast_batch_decoders"
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


def decoder_for(model, levers: Optional[Levers], caches=None, policy=None) -> Optional[FastDecoder]:
    """The fast decoder for this model and levers, or None where decode stays on L1
    (levers off, or a model/cache the fast step does not cover: logged once)."""
    if levers is None:
        return None
    prepare(model, levers)
    if not levers.fast_decode:
        return None
    reason = why_not(model, caches, policy)
    if reason:
        log.info("fast decode not used: %s", reason)
        return None
    return _kept(model, _ATTR, levers, FastDecoder)


def batch_decoder_for(model, levers: Optional[Levers], policy=None) -> Optional[FastBatchDecoder]:
    """The batch rows' fast decoder (`fast_batch` with a fast lever on), or None where the
    rows stay on L1 (lever off, or a model the fast step does not cover: logged once)."""
    if levers is None or not levers.fast_batch_decode:
        return None
    prepare(model, levers)
    reason = why_not(model, None, policy)
    if reason:
        log.info("fast batch decode not used: %s", reason)
        return None
    return _kept(model, _BATCH_ATTR, levers, FastBatchDecoder)


def _kept(model, attr: str, levers: Levers, make):
    store = getattr(model, attr, None)
    if store is None:
        store = {}
        object.__setattr__(model, attr, store)
    dec = store.get(levers)
    if dec is None:
        dec = store[levers] = make(model, levers)
    return dec


def describe(levers: Optional[Levers], model=None) -> dict:
    """Tier and levers in force, for /stats and benchmark reports."""
    out = (levers or Levers()).as_dict()
    if model is not None and levers is not None and levers.fast_decode:
        reason = why_not(model)
        out["fast_decode"] = reason is None
        if reason:
            out["fast_decode_reason"] = reason
        store = getattr(model, _ATTR, {}) or {}
        dec = store.get(levers)
        if dec is not None:
            out["fast_stats"] = dict(vars(dec.stats))
        bdec = (getattr(model, _BATCH_ATTR, {}) or {}).get(levers)
        if bdec is not None:
            out["fast_batch_stats"] = dict(vars(bdec.stats))
    return out
