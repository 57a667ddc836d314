"""Gemma 3 text decoder (`model_type: gemma3_text`).

- RMSNorm scales by `1 + weight` (every norm, including the per-head q/k norms).
- Embeddings are multiplied by `sqrt(hidden_size)` rounded to bfloat16 first.
- Layer i is a global (full-attention) layer when `(i + 1) % sliding_window_pattern == 0`,
  otherwise a sliding-window layer; a config's `layer_types` is not consulted.
  Sliding layers use RoPE base `rope_local_base_freq`, global layers `rope_theta`
  with the optional `rope_scaling` (linear for the 4B+ checkpoints).
- Attention scale is `query_pre_attn_scalar ** -0.5`; GeGLU MLP; four sandwich norms.
- The output head is tied when the checkpoint has no `lm_head.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .base import ArgsBase, attention, attention_mask, make_rope, rope_and_cache
from engine.kv.cache import KVCache, RotatingKVCache


@dataclass
class Args(ArgsBase):
    model_type: str = "gemma3_text"
    hidden_size: int = 1152
    num_hidden_layers: int = 26
    intermediate_size: int = 6912
    num_attention_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1.0e-6
    vocab_size: int = 262144
    num_key_value_heads: int = 1
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    max_position_embeddings: int = 32768
    rope_scaling: Optional[dict] = None

    def is_global(self, i: int) -> bool:
        return (i + 1) % self.sliding_window_pattern == 0


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose effective scale is `1 + weight`."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


@partial(mx.compile, shapeless=True)
def residual_add(x, y):
    """x + y; in float16 the sum is taken in float32 and clipped to the float16 range."""
    if x.dtype != mx.float16:
        return x + y
    top = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -top, top).astype(mx.float16)


class Attention(nn.Module):
    def __init__(self, a: Args, idx: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            a.num_attention_heads, a.num_key_value_heads, a.head_dim)
        self.scale = a.query_pre_attn_scalar ** -0.5
        d, hd = a.hidden_size, a.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = OffsetRMSNorm(hd, a.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(hd, a.rms_norm_eps)
        if a.is_global(idx):
            self.rope = make_rope(hd, a.rope_theta, False, a.rope_scaling, a.max_position_embeddings)
        else:
            self.rope = make_rope(hd, a.rope_local_base_freq, False)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)
        out = attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    """GeGLU, evaluated op by op (not as one compiled kernel)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: Args, idx: int):
        super().__init__()
        self.sliding = not a.is_global(idx)
        self.self_attn = Attention(a, idx)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        norm = lambda: OffsetRMSNorm(a.hidden_size, a.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, mask=None, cache=None):
        h = residual_add(x, self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), mask, cache)))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return residual_add(h, self.post_feedforward_layernorm(r))


class Backbone(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Block(a, i) for i in range(a.num_hidden_layers)]
        self.norm = OffsetRMSNorm(a.hidden_size, a.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: Args):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._tied = False   # decided by `sanitize` from the checkpoint

    @property
    def layers(self):
        return self.model.layers

    def embed(self, inputs):
        h = self.model.embed_tokens(inputs)
        return h * mx.array(self.args.hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)

    def begin(self, inputs, cache=None, input_embeddings=None):
        if input_embeddings is not None:
            h = input_embeddings * mx.array(self.args.hidden_size ** 0.5,
                                            mx.bfloat16).astype(input_embeddings.dtype)
        else:
            h = self.embed(inputs)
        caches = cache if cache is not None else [None] * len(self.layers)
        pattern = self.args.sliding_window_pattern
        full = attention_mask(h, caches[pattern - 1])
        swa = attention_mask(h, caches[0], window=self.args.sliding_window) if pattern > 1 else None
        masks = [swa if l.sliding else full for l in self.layers]
        return h, {"masks": masks, "caches": caches}

    def layer_step(self, i, h, ctx):
        return self.layers[i](h, ctx["masks"][i], ctx["caches"][i])

    def head(self, h):
        h = self.model.norm(h)
        return self.model.embed_tokens.as_linear(h) if self._tied else self.lm_head(h)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h, ctx = self.begin(inputs, cache, input_embeddings)
        for i in range(len(self.layers)):
            h = self.layer_step(i, h, ctx)
        return self.head(h)

    def sanitize(self, weights: dict) -> dict:
        if "lm_head.weight" not in weights and not self._tied:
            self._tied = True
            self.pop("lm_head")
        return weights

    def make_cache(self):
        return [RotatingKVCache(self.args.sliding_window) if l.sliding else KVCache()
                for l in self.layers]
