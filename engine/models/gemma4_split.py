"""Gemma 4 text blocks split for token-chunked training (see engine/models/split.py).

`token_split(layer, window)` returns the per-token parts of a gemma4_text
`Layer` around attention, op for op as `Layer.__call__` runs them without a
cache: before attention the input norm, q (+ k, v for layers with their own
K/V) projections, q/k norms, the weightless v norm and RoPE; after it o_proj,
the post-attention norm and residual, the MLP with its norms and residual, the
gated per-layer input and the layer scalar. KV-shared layers (`shared`) only
produce q; their K/V are the donor layer's.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .split import TokenSplit


# The members of the dense layer this split reproduces; a layer with anything else
# (e.g. a mixture-of-experts block) gets no split and trains through its own __call__.
KNOWN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
         "pre_feedforward_layernorm", "post_feedforward_layernorm", "per_layer_input_gate",
         "per_layer_projection", "post_per_layer_input_norm", "layer_scalar"}


def token_split(layer, window: Optional[int]) -> Optional[TokenSplit]:
    if not set(layer.keys()) <= KNOWN:
        return None
    attn = layer.self_attn

    def pre(x, offset):
        B, L, _ = x.shape
        n = layer.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(n).reshape(B, L, attn.n_heads, attn.head_dim))
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=offset)
        if not attn.has_kv:
            return (q,)
        k = attn.k_proj(n).reshape(B, L, attn.n_kv_heads, attn.head_dim)
        v = k if attn.k_eq_v else attn.v_proj(n).reshape(B, L, attn.n_kv_heads, attn.head_dim)
        k = attn.rope(attn.k_norm(k).transpose(0, 2, 1, 3), offset=offset)
        v = attn.v_norm(v).transpose(0, 2, 1, 3)
        return q, k, v

    def post(x, o, pli=None):
        h = x + layer.post_attention_layernorm(attn.o_proj(o))
        h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        if layer.per_layer_input and pli is not None:
            g = nn.gelu_approx(layer.per_layer_input_gate(h))
            g = layer.per_layer_projection(mx.multiply(g, pli))
            h = h + layer.post_per_layer_input_norm(g)
        return h * layer.layer_scalar

    return TokenSplit(pre=pre, post=post, scale=1.0, window=window if attn.sliding else None,
                      shared=not attn.has_kv)
