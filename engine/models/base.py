"""Helpers shared by every architecture: config args, masks, attention, RoPE.

Bit-exactness with mlx-lm depends on issuing the *same* MLX primitives in the
same order with the same dtypes (a fused `mx.compile` kernel and the same ops
run eagerly can round differently in bf16). So the activations below are
compiled the same way real MLX model code compiles them, and the masks are the
same boolean arrays / "causal" strings handed to `mx.fast.scaled_dot_product_attention`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

import engine.kv.dequant_attention as kv_dequant_attention
from engine.models import bucketed_sdpa
from engine.kv.masks import causal_mask


@dataclass
class ArgsBase:
    """Dataclass configs built from a HF `config.json` dict; unknown keys are ignored."""

    @classmethod
    def from_dict(cls, params: dict):
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in names})


# --- activations -----------------------------------------------------------


@partial(mx.compile, shapeless=True)
def silu_gate(gate, x):
    return nn.silu(gate) * x


@partial(mx.compile, shapeless=True)
def gelu_gate(gate, x):
    return nn.gelu_approx(gate) * x


@partial(mx.compile, shapeless=True)
def softcap(cap, x):
    return mx.tanh(x / cap) * cap


class GatedMLP(nn.Module):
    """gate/up/down MLP (SwiGLU or GeGLU); names match HF checkpoints."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act=silu_gate):
        super().__init__()
        # built gate, up, down (the random-init order the fixtures were made with) but
        # registered gate, down, up: the parameter order mlx-lm's models have, which is
        # the tensor order of a converted checkpoint (engine-convert's byte parity)
        gate = nn.Linear(dim, hidden, bias=bias)
        up = nn.Linear(dim, hidden, bias=bias)
        down = nn.Linear(hidden, dim, bias=bias)
        self.gate_proj, self.down_proj, self.up_proj = gate, down, up
        self._act = act

    @property
    def act(self):
        """The gating function, act(gate, up) (silu_gate or gelu_gate)."""
        return self._act

    def __call__(self, x):
        return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))


class ScalelessRMSNorm(nn.Module):
    """RMSNorm with no learned weight (Gemma 4's value norm)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, None, self.eps)


# --- masks -------------------------------------------------------------------


def attention_mask(h: mx.array, cache=None, window: Optional[int] = None):
    """The mask for a forward of h [B, T, D] given the layer's cache (or none)."""
    n = h.shape[1]
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(n, window_size=window)
    if n == 1:
        return None
    if window and n > window:
        return causal_mask(n, window=window)
    return "causal"


# --- attention ---------------------------------------------------------------


def _quantized_attention(q, qk, qv, scale, mask, group_size, bits):
    """Attention over affine-quantized K/V tuples (packed, scales, biases)."""
    B, n_heads, L, D = q.shape
    n_kv = qk[0].shape[-3]
    rep = n_heads // n_kv
    q = q * scale
    if rep > 1:
        q = mx.reshape(q, (B, n_kv, rep, L, D))
        qk = tuple(mx.expand_dims(t, axis=-3) for t in qk)
        qv = tuple(mx.expand_dims(t, axis=-3) for t in qv)
    scores = mx.quantized_matmul(q, *qk, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            ql, kl = scores.shape[-2:]
            mask = mx.arange(kl - ql, kl)[:, None] >= mx.arange(kl)[None]
        if rep > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *qv, transpose=False, group_size=group_size, bits=bits)
    if rep > 1:
        out = mx.reshape(out, (B, n_heads, L, D))
    return out


def rope_and_cache(rope, q, k, v, cache):
    """Rotate q and k at the cache's offset and append k, v to the cache (if any)."""
    if cache is None:
        return rope(q), rope(k), v
    q = rope(q, offset=cache.offset)
    k = rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    return q, k, v


_OVERRIDE = None     # set by engine.fast.invariant.enable: every attention through it


def set_attention_override(fn) -> None:
    """Route every `attention` call through fn(q, k, v, scale, mask, cache) (None: off).
    engine.fast.invariant sets it for deterministic mode on CUDA; kept here so that importing
    the models imports no kernel code."""
    global _OVERRIDE
    _OVERRIDE = fn


def attention_overridden() -> bool:
    """Whether `set_attention_override` has routed attention elsewhere."""
    return _OVERRIDE is not None


def attention(q, k, v, cache, scale: float, mask):
    """SDPA, dispatching to the quantized path when the cache holds quantized K/V, in
    deterministic mode on CUDA to the batch-invariant kernel (`set_attention_override`), and on
    CUDA a multi-token query to padded shapes (`engine.models.bucketed_sdpa`)."""
    if cache is not None and getattr(cache, "bits", None):
        if kv_dequant_attention.enabled():   # L3, off by default (see that module)
            k = mx.dequantize(*k, group_size=cache.group_size, bits=cache.bits).astype(q.dtype)
            v = mx.dequantize(*v, group_size=cache.group_size, bits=cache.bits).astype(q.dtype)
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return _quantized_attention(q, k, v, scale, mask, cache.group_size, cache.bits)
    if _OVERRIDE is not None:    # (deterministic mode on CUDA: engine.fast.invariant)
        return _OVERRIDE(q, k, v, scale, mask, cache)
    if bucketed_sdpa.takes(q, k, mask):    # (multi-token queries on CUDA: recurring cuDNN plans)
        return bucketed_sdpa.sdpa(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# --- rope ----------------------------------------------------------------------


class FreqRoPE(nn.Module):
    """RoPE with explicit per-pair frequencies (llama3 scaling, proportional/partial)."""

    def __init__(self, dims: int, freqs: mx.array, traditional: bool = False):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self._freqs = freqs

    def __call__(self, x, offset=0):
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0,
            offset=offset, freqs=self._freqs,
        )


def _llama3_freqs(dims: int, base: float, cfg: dict) -> mx.array:
    factor = cfg["factor"]
    low = cfg.get("low_freq_factor", 1.0)
    high = cfg.get("high_freq_factor", 4.0)
    old_ctx = cfg.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_ctx / wavelens - low) / (high - low)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(medium, smoothed, freqs)


def make_rope(dims: int, base: float, traditional: bool = False,
              scaling: Optional[dict] = None, max_positions: Optional[int] = None):
    """RoPE from a HF `rope_scaling` / `rope_parameters` block."""
    kind = "default"
    if scaling is not None:
        kind = scaling.get("type") or scaling.get("rope_type", "default")
    if kind in ("default", "linear"):
        scale = 1 / scaling["factor"] if kind == "linear" else 1.0
        return nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    if kind == "llama3":
        return FreqRoPE(dims, _llama3_freqs(dims, base, scaling), traditional)
    if kind == "proportional":
        # Rotate the first `rotated` dims with exponents over the *full* head dim;
        # the remaining pairs get an infinite period (left unrotated).
        rotated = int(dims * scaling.get("partial_rotary_factor", 1.0))
        if rotated > dims:
            raise ValueError("partial_rotary_factor must be <= 1")
        exps = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
        freqs = mx.concatenate([
            scaling.get("factor", 1.0) * (base ** exps),
            mx.full(((dims - rotated) // 2,), mx.inf),
        ])
        return FreqRoPE(dims, freqs, traditional)
    raise ValueError(f"unsupported rope type {kind!r}")


def rope_settings(args) -> tuple[float, Optional[dict]]:
    """(theta, scaling) from either the classic keys or transformers-5 `rope_parameters`."""
    theta = getattr(args, "rope_theta", None)
    scaling = getattr(args, "rope_scaling", None)
    params = getattr(args, "rope_parameters", None)
    if params:
        if theta is None:
            theta = params.get("rope_theta")
        if scaling is None:
            scaling = params
    if theta is None:
        raise ValueError("rope_theta is missing from the model config")
    return theta, scaling


def inv_sqrt(x: float) -> float:
    return x ** -0.5


__all__ = [
    "ArgsBase", "GatedMLP", "ScalelessRMSNorm", "attention", "attention_mask",
    "causal_mask", "gelu_gate", "make_rope", "rope_and_cache", "rope_settings", "silu_gate", "softcap",
    "inv_sqrt", "math", "Any",
]
