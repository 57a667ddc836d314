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

Not here yet (the GPU part of #41): batch-invariant kernels for the fast runner (L3) and
for MLX's GPU matmuls and attention, whose reduction split depends on the number of rows.
Their switch is `engine.fast.config.FastConfig.deterministic`, which `check` sets and the
fast runner (`engine.fast.apply.fast_step_for`) refuses until they exist; `check` refuses a
GPU default device for the same reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import mlx.core as mx

__all__ = ["DeterministicUnsupported", "check", "why_not_deterministic"]


class DeterministicUnsupported(ValueError):
    """Deterministic mode asked for where it is not built (the message says why)."""


def why_not_deterministic(levers=None, device=None) -> Optional[str]:
    """Why deterministic mode cannot run with these levers on this device (None: it can)."""
    if levers is not None and levers.fast_decode:
        return ("--deterministic does not run with the fast runner (--tier l3 or a fast "
                "lever: compiled_decode, perf_kernel, fused_sdpa) yet: its batch-invariant "
                "kernels are not built; use --tier l1")
    device = device if device is not None else mx.default_device()
    if device.type != mx.cpu:
        return ("--deterministic is built for the CPU backend only: on a GPU the stock "
                "matmul and attention kernels split their reductions by the number of rows, "
                "and batch-invariant ones are not built yet")
    return None


def check(levers=None, device=None):
    """The levers to run deterministic mode with (their fast config marked deterministic),
    or `DeterministicUnsupported`."""
    why = why_not_deterministic(levers, device)
    if why is not None:
        raise DeterministicUnsupported(why)
    if levers is None:
        return None
    return replace(levers, fast=replace(levers.fast, deterministic=True))
