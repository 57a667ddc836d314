"""Llama family (Llama 2/3, Mistral-style, MiniCPM5 which ships as `llama`).

Optional per-layer `layer_types` with `sliding_attention` layers (Ministral-style)
use a rotating cache of `sliding_window` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .base import ArgsBase, GatedMLP, attention, attention_mask, make_rope, rope_and_cache
from .base import rope_settings
from .split import HalfSplit, TokenSplit
from engine.kv.cache import KVCache, RotatingKVCache


@dataclass
class Args(ArgsBase):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: Optional[float] = None
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    rope_parameters: Optional[dict] = None
    # HF's LlamaConfig defaults to untied; mlx-lm's defaults to tied. Real
    # checkpoints always say, and our fixtures always write it.
    tie_word_embeddings: bool = True
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.rope_theta is None and not self.rope_parameters:
            self.rope_theta = 10000.0


class Attention(nn.Module):
    def __init__(self, a: Args, o_bias: Optional[bool] = None):
        """o_bias: whether the output projection has a bias (None: as q/k/v, `attention_bias`)."""
        super().__init__()
        self.n_heads = a.num_attention_heads
        self.n_kv_heads = a.num_key_value_heads
        self.head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
        self.scale = self.head_dim ** -0.5
        bias = a.attention_bias
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, a.hidden_size,
                                bias=bias if o_bias is None else o_bias)
        theta, scaling = rope_settings(a)
        self.rope = make_rope(self.head_dim, theta, a.rope_traditional, scaling,
                              a.max_position_embeddings)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)
        out = attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Block(nn.Module):
    branch_scale = None  # MiniCPM scales both residual branches

    def __init__(self, a: Args, sliding: bool, attention=None):
        super().__init__()
        self.sliding = sliding
        self.window = a.sliding_window if sliding else None
        # a family's own attention is built here, once (building a second one would draw
        # the random initialisation twice: a seeded run would then differ from mlx-lm's)
        self.self_attn = (attention or Attention)(a)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _branch(self, y):
        return y if self.branch_scale is None else y * self.branch_scale

    def half_split(self) -> HalfSplit:
        """The block as attention half + per-token MLP half (training, no cache)."""
        return HalfSplit(
            attn=lambda x, mask: x + self._branch(self.self_attn(self.input_layernorm(x), mask, None)),
            mlp=lambda h: h + self._branch(self.mlp(self.post_attention_layernorm(h))))

    def token_split(self) -> TokenSplit:
        """Per-token parts around attention (see engine/models/split.py)."""
        attn = self.self_attn
        qk_norm = hasattr(attn, "q_norm")  # qwen3

        def pre(x, offset):
            B, L, _ = x.shape
            n = self.input_layernorm(x)
            q = attn.q_proj(n).reshape(B, L, attn.n_heads, -1)
            k = attn.k_proj(n).reshape(B, L, attn.n_kv_heads, -1)
            if qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
            v = attn.v_proj(n).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

        def post(x, o, extra=None):
            h = x + self._branch(attn.o_proj(o))
            return h + self._branch(self.mlp(self.post_attention_layernorm(h)))

        return TokenSplit(pre=pre, post=post, scale=attn.scale, window=self.window)


class Backbone(nn.Module):
    def __init__(self, a: Args, attention=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Block(a, t == "sliding_attention", attention) for t in a.layer_types]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)


class Model(nn.Module):
    """Decoder stack; `begin` / `layer_step` / `head` split the forward so the
    trainer can run it segment by segment."""

    attention = None       # a family's attention class (None: llama's)

    def __init__(self, args: Args):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args, self.attention)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        types = args.layer_types
        self._full_idx = types.index("full_attention") if "full_attention" in types else None
        self._swa_idx = types.index("sliding_attention") if "sliding_attention" in types else None

    @property
    def layers(self):
        return self.model.layers

    def embed(self, inputs):
        return self.model.embed_tokens(inputs)

    def begin(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed(inputs)
        caches = cache if cache is not None else [None] * len(self.layers)
        full = attention_mask(h, caches[self._full_idx]) if self._full_idx is not None else None
        swa = None
        if self._swa_idx is not None:
            swa = attention_mask(h, caches[self._swa_idx], window=self.args.sliding_window)
        masks = [swa if l.sliding else full for l in self.layers]
        return h, {"masks": masks, "caches": caches}

    def layer_step(self, i, h, ctx):
        return self.layers[i](h, ctx["masks"][i], ctx["caches"][i])

    def head_parts(self):
        """(final norm, output projection) that `head` applies: the projection is the
        tied embedding (used as a linear layer) or lm_head."""
        return self.model.norm, (self.model.embed_tokens if self.args.tie_word_embeddings
                                 else self.lm_head)

    def head(self, h):
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h, ctx = self.begin(inputs, cache, input_embeddings)
        for i in range(len(self.layers)):
            h = self.layer_step(i, h, ctx)
        return self.head(h)

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def make_cache(self):
        return [RotatingKVCache(self.args.sliding_window) if l.sliding else KVCache()
                for l in self.layers]
