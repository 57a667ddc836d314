"""Deterministic mode (issue #41): a row's logits do not depend on what else is in the batch.

`Engine(deterministic=True)` (`--deterministic` on engine-generate and engine-serve): every
row's logits, hence its logprobs and its greedy or seeded tokens, are bit-identical
whatever the batch size, the other rows' prompts and lengths, the row's position in the
batch, the prefill chunking and a prompt-cache hit (docs/deterministic.md).

How, on the CPU (MLX's stock kernels, mlx 0.32.4; `tests/engine/test_deterministic.py`
checks each property on its own and end to end):

- the matmuls (float and quantized) reduce every output row in the same order whatever
  the number of rows, so projections, MLP and the head are batch- and chunk-invariant;
- scaled-dot-product attention reads the keys in their order and a masked key (left
  padding, a row shorter than the batch's longest, the causal part of a prefill chunk)
  adds an exact zero, so padding, batching and chunking leave a row's output alone;
- what did differ: a sliding-window layer's ring buffer. Its write position is the
  batch's (padding included), not the row's, so a row's window was read in a rotation
  that depends on the batch, and the sums of the softmax and of probs @ V round by key
  order (Gemma 3/4 float32: 6-31% of positions differed, reports/batch_invariance).
  Deterministic mode keeps every sliding window in temporal order
  (`engine.kv.cache.temporal_caches`; the batched ring: `BatchRotatingKVCache.temporal`),
  in the batch runner and the exact runner alike;
- sampling: a row with a seed draws from its own key; greedy takes the row's argmax. A
  request with temperature > 0 and no seed draws from the global generator (its logits are
  still the same; its tokens are not guaranteed).

With max_batch 1 the Engine runs every request on the batch runner (one row) in this
mode, so one code path serves every batch size.

On CUDA (MLX's CUDA backend) the stock kernels are not invariant: the matmuls pick their
kernel and reduction split by the number of rows, and attention decodes with one kernel and
prefills with another (cuDNN), each splitting the keys by the call's lengths. There `prepare`
makes the model run `engine.fast.invariant`'s batch-invariant forms (every matmul on blocks of
a fixed number of rows, attention through a kernel whose order depends on the row alone), for
the full-attention dense models it covers (`engine.fast.invariant.SUPPORTED`), with float KV
and without adapters. Metal and the fast runner (`--tier l3`) are refused: no invariant kernels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import mlx.core as mx

from engine.models.bucketed_sdpa import on_cuda

__all__ = ["DeterministicUnsupported", "check", "prepare", "why_not_deterministic"]


class DeterministicUnsupported(ValueError):
    """Deterministic mode asked for where it is not built (the message says why)."""


def why_not_deterministic(levers=None, device=None, model=None, kv_quantized: bool = False) -> Optional[str]:
    """Why deterministic mode cannot run with these levers on this device, for this model
    (None: it can). kv_quantized: the engine stores K/V quantized."""
    if levers is not None and levers.fast_decode:
        return ("--deterministic does not run with the fast runner (--tier l3 or a fast "
                "lever: compiled_decode, perf_kernel, fused_sdpa) yet: its batch-invariant "
                "kernels are not built; use --tier l1")
    device = device if device is not None else mx.default_device()
    if device.type == mx.cpu:
        return None
    if not on_cuda(device):
        return ("--deterministic is built for the CPU and CUDA backends: on Metal the stock "
                "matmul and attention kernels split their reductions by the number of rows, "
                "and batch-invariant ones are not built there")
    if kv_quantized:
        return ("--deterministic on a GPU keeps K/V in the model's dtype: quantized KV "
                "(--kv-bits, --kv-config) has no batch-invariant attention yet")
    if model is not None:
        from engine.fast import invariant   # (the kernels' module: only where they may run)
        return invariant.why_unsupported(model)
    return None


def check(levers=None, device=None, model=None, kv_quantized: bool = False):
    """The levers to run deterministic mode with (their fast config marked deterministic),
    or `DeterministicUnsupported`."""
    why = why_not_deterministic(levers, device, model, kv_quantized)
    if why is not None:
        raise DeterministicUnsupported(why)
    if levers is None:
        return None
    return replace(levers, fast=replace(levers.fast, deterministic=True))


def refuses_adapters() -> bool:
    """Whether requests with adapters are refused (deterministic mode on CUDA: their low-rank
    matmuls have no batch-invariant form yet)."""
    from engine.models.base import attention_overridden
    return attention_overridden()


def check_adapters() -> None:
    """A ValueError (a 400 on the server) where requests with adapters are refused."""
    if refuses_adapters():
        raise ValueError("--deterministic on a GPU does not run adapters yet (their low-rank "
                         "matmuls have no batch-invariant form); run without adapters or on the CPU")


def setup(levers, model, draft_model=None, kv_quantized: bool = False):
    """An Engine's deterministic mode: `check` (the levers to run with, or
    DeterministicUnsupported), then `prepare` on the target and draft models."""
    levers = check(levers, model=model, kv_quantized=kv_quantized)
    prepare(model, draft_model)
    return levers


def prepare(*models, device=None) -> bool:
    """On CUDA: the models' matmuls on fixed row blocks and every attention through the
    batch-invariant kernel (`engine.fast.invariant`). Elsewhere nothing (the CPU's stock
    kernels are invariant). Returns whether anything was changed."""
    if not on_cuda(device):
        return False
    from engine.fast import invariant
    for model in models:
        why = invariant.why_unsupported(model) if model is not None else None
        if why is not None:
            raise DeterministicUnsupported(why)
    for model in models:
        if model is not None:
            invariant.apply(model)
    invariant.enable()
    return True
