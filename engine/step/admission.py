"""Memory admission: the largest context that fits a memory budget.

peak(T) = weights + KV(T) + transient(prefill chunk)

- weights: the bytes of every parameter (quantized weights at their packed size);
- KV(T): per cache-owning layer, K+V bytes per token (n_kv_heads * head_dim *
  element size, or for quantized layers packed bits plus scale/bias per group)
  times T, except sliding-window layers, which stop growing at their window
  (plus a chunk while prefilling); KV-sharing layers own no cache;
- the cache grows in 256-token steps, so T is rounded up to the next step;
- transient: the largest prefill chunk's working set: its attention scores
  (heads x chunk x keys, calibrated factor below) and activations (chunk x MLP
  width), plus the logits row of the last position.

A request whose prompt + max_tokens exceeds the ceiling is refused before any
compute with `ContextOverBudget`, which carries both numbers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from mlx.utils import tree_flatten

STEP = 256

# The prompt cache's default cap: this fraction of what the budget leaves after the
# weights (the rest is for the running requests' KV and working memory; admission does
# not reserve the cache's share, so a full cache and a request at the ceiling together
# can go past the budget by at most this much).
PROMPT_CACHE_FRACTION = 0.25


class ContextOverBudget(ValueError):
    def __init__(self, requested: int, ceiling: int, budget_bytes: int):
        self.requested, self.ceiling, self.budget_bytes = requested, ceiling, budget_bytes
        super().__init__(
            f"context of {requested} tokens (prompt + max_tokens) exceeds the admission "
            f"ceiling of {ceiling} tokens for a memory budget of {budget_bytes / 1e9:.2f} GB")


def machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        return 8 << 30


def default_budget(fraction: float = 0.75) -> int:
    return int(machine_memory() * fraction)


def _backend() -> str:
    import mlx.core as mx
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@dataclass
class LayerKV:
    bytes_per_token: float
    window: Optional[int]   # None = grows with the context


def _elem_bytes(model) -> int:
    # K/V take the activation dtype: that of the float parameters (a quantized
    # model's scales carry it too).
    import mlx.core as mx
    for _, v in tree_flatten(model.parameters()):
        if v.dtype in (mx.float32, mx.bfloat16, mx.float16):
            return v.dtype.size
    return 2


def layer_kv(model, policy=None) -> list[LayerKV]:
    """Per cache-owning layer, its K+V bytes per token (at its quantization)."""
    caches = model.make_cache()
    elem = _elem_bytes(model)
    qmap = policy.layers if policy is not None else {}
    out = []
    for i, (layer, cache) in enumerate(zip(model.layers, caches)):
        attn = layer.self_attn
        per_head = attn.head_dim
        if i in qmap:
            bits, group = qmap[i]
            per_head = attn.head_dim * bits / 8 + 2 * elem * attn.head_dim / group
            bpt = 2 * attn.n_kv_heads * per_head
        else:
            bpt = 2 * attn.n_kv_heads * per_head * elem
        out.append(LayerKV(bpt, getattr(cache, "max_size", None)))
    return out


def _round_up(t: int) -> int:
    return max(STEP, math.ceil(t / STEP) * STEP)


@dataclass
class Admission:
    budget_bytes: int
    weights: int
    layers: list
    hidden: int
    mlp: int
    heads: int
    vocab: int
    prefill_step: int = 2048
    elem: int = 2
    backend: str = "cpu"

    @classmethod
    def for_model(cls, model, budget_bytes: Optional[int] = None, policy=None,
                  prefill_step: int = 2048):
        a = getattr(model, "args", None)
        hidden = getattr(a, "hidden_size", 0)
        mlp = getattr(a, "intermediate_size", 0) * 2
        heads = getattr(a, "num_attention_heads", 1)
        vocab = getattr(a, "vocab_size", 0)
        return cls(budget_bytes if budget_bytes is not None else default_budget(),
                   weight_bytes(model), layer_kv(model, policy), hidden, mlp, heads, vocab,
                   prefill_step, _elem_bytes(model), _backend())

    def with_draft(self, draft_model) -> "Admission":
        """This admission counting a draft model too (speculative decoding): its weights,
        and its KV cache, which holds every token the model's does."""
        from dataclasses import replace
        return replace(self, weights=self.weights + weight_bytes(draft_model),
                       layers=self.layers + layer_kv(draft_model, None))

    def kv_bytes(self, tokens: int) -> int:
        total = 0.0
        for l in self.layers:
            t = tokens if l.window is None else min(tokens, l.window + min(tokens, self.prefill_step))
            total += l.bytes_per_token * (_round_up(t) if l.window is None else t)
        return int(total)

    # Calibrated with experiments/admission.py (reports/admission/):
    # - CPU: attention over a prefill chunk materialises scores/probabilities worth
    #   ~1.35x one [heads, chunk, keys] tensor in the activation dtype; ~1 MB slack.
    # - GPU (CUDA): attention is fused (no score tensor); ~1.1 GB fixed runtime
    #   workspace measured on an H200 with a 1.1B model.
    # On both, while a growing cache extends, the old and new buffers coexist, and
    # attention reads a contiguous copy of the live K/V: growing layers peak at
    # ~2x their K/V plus the previous chunk's buffer.
    SCORES_FACTOR = {"cpu": 1.35, "gpu": 0.0}
    FIXED_SLACK = {"cpu": 1 << 20, "gpu": 1_100_000_000}

    def _grow_bytes(self, tokens: int) -> int:
        if tokens <= self.prefill_step:
            return self._growing_kv(tokens)          # the contiguous copy only
        return self._growing_kv(tokens) + self._growing_kv(tokens - self.prefill_step)

    def _growing_kv(self, tokens: int) -> int:
        return int(sum(l.bytes_per_token for l in self.layers if l.window is None) * tokens)

    def transient_bytes(self, tokens: int) -> int:
        chunk = min(tokens, self.prefill_step)
        scores = self.SCORES_FACTOR[self.backend] * self.elem * self.heads * chunk * tokens
        acts = chunk * (self.hidden * 4 + self.mlp) * 4
        # sliding-window layers attend with an explicit boolean mask [chunk, keys]
        windows = [l.window for l in self.layers if l.window is not None]
        mask = chunk * min(tokens, chunk + max(windows)) if windows else 0
        return int(scores + acts + mask + self.vocab * 4 * 2 + self._grow_bytes(tokens)
                   + self.FIXED_SLACK[self.backend])

    def predicted_peak(self, tokens: int) -> int:
        return self.weights + self.kv_bytes(tokens) + self.transient_bytes(tokens)

    def max_context(self) -> int:
        """Largest T with predicted_peak(T) <= budget (0 if even the weights don't fit)."""
        if self.predicted_peak(1) > self.budget_bytes:
            return 0
        lo, hi = 1, 1
        while self.predicted_peak(hi) <= self.budget_bytes and hi < 1 << 24:
            lo, hi = hi, hi * 2
        if hi >= 1 << 24:
            return hi
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if self.predicted_peak(mid) <= self.budget_bytes:
                lo = mid
            else:
                hi = mid
        return lo

    def prompt_cache_bytes(self, fraction: float = PROMPT_CACHE_FRACTION) -> int:
        """The prompt cache's default cap: `fraction` of the budget left after the weights."""
        return max(0, int((self.budget_bytes - self.weights) * fraction))

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        need = prompt_tokens + max_tokens
        ceiling = self.max_context()
        if need > ceiling:
            raise ContextOverBudget(need, ceiling, self.budget_bytes)

    def batch_fits(self, needs: list, held: int) -> bool:
        """Whether rows of these context lengths (prompt + max_tokens) fit together, `held`
        rows' KV held (the fast runner's bucket, idle rows included); every row's KV padded
        to the longest row."""
        longest = max(needs)
        per_row = self.transient_bytes(min(longest, self.prefill_step)) - self.FIXED_SLACK[self.backend]
        peak = (self.weights + held * self.kv_bytes(longest) + self.transient_bytes(longest)
                + (min(len(needs), 8) - 1) * per_row)
        return peak <= self.budget_bytes

    def describe(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "weight_bytes": self.weights,
                "kv_bytes_per_token": sum(l.bytes_per_token for l in self.layers if l.window is None),
                "sliding_layers": sum(1 for l in self.layers if l.window is not None),
                "max_context": self.max_context()}
