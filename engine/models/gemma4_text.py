"""Gemma 4 text decoder (dense): the E-variants (KV sharing, per-layer inputs)
and the large dense variants (`attention_k_eq_v`).

- Layers alternate sliding-window and full attention (`layer_types`), each
  type with its own head_dim (`head_dim` / `global_head_dim`), KV heads and
  RoPE (`rope_parameters[type]`; full layers use partial "proportional" RoPE).
- Attention scale is 1.0; queries and keys get RMSNorm with weights, values
  a weightless RMSNorm. With `attention_k_eq_v`, full layers use the raw key
  projection as values.
- The last `num_kv_shared_layers` layers have no K/V of their own: each
  reuses the K/V (and RoPE offset) of the last earlier layer of its type.
- Per-layer inputs (`hidden_size_per_layer_input`): a per-token embedding
  table plus a projection of the hidden state feed a gated residual in each
  layer.
- Output logits are soft-capped: `tanh(x / cap) * cap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .base import ArgsBase, GatedMLP, ScalelessRMSNorm, attention, attention_mask, gelu_gate
from .base import make_rope, softcap
from . import gemma4_moe
from engine.kv.cache import KVCache, RotatingKVCache

DEFAULT_ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                       "rope_type": "proportional"},
    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                          "rope_type": "default"},
}


@dataclass
class Args(ArgsBase):
    model_type: str = "gemma4_text"
    hidden_size: int = 1536
    num_hidden_layers: int = 35
    intermediate_size: int = 6144
    num_attention_heads: int = 8
    head_dim: int = 256
    global_head_dim: int = 512
    rms_norm_eps: float = 1e-6
    vocab_size: int = 262144
    vocab_size_per_layer_input: int = 262144
    num_key_value_heads: int = 1
    num_global_key_value_heads: Optional[int] = None
    num_kv_shared_layers: int = 20
    hidden_size_per_layer_input: int = 256
    rope_traditional: bool = False
    rope_parameters: Optional[Dict] = None
    sliding_window: int = 512
    sliding_window_pattern: int = 5
    max_position_embeddings: int = 131072
    attention_k_eq_v: bool = False
    final_logit_softcapping: Optional[float] = 30.0
    use_double_wide_mlp: bool = True
    enable_moe_block: bool = False
    num_experts: Optional[int] = None
    top_k_experts: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    layer_types: Optional[List[str]] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts
                                          and self.moe_intermediate_size):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and "
                             "moe_intermediate_size")
        if self.rope_parameters is None:
            self.rope_parameters = DEFAULT_ROPE
        if self.layer_types is None:
            pattern = ["sliding_attention"] * (self.sliding_window_pattern - 1) + ["full_attention"]
            self.layer_types = (pattern * (self.num_hidden_layers // len(pattern) + 1))[
                : self.num_hidden_layers]

    @property
    def first_shared(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers


class Attention(nn.Module):
    def __init__(self, a: Args, idx: int):
        super().__init__()
        self.layer_type = a.layer_types[idx]
        self.sliding = self.layer_type == "sliding_attention"
        self.has_kv = idx < a.first_shared
        self.head_dim = a.head_dim if self.sliding or not a.global_head_dim else a.global_head_dim
        self.n_heads = a.num_attention_heads
        self.k_eq_v = a.attention_k_eq_v and not self.sliding
        self.n_kv_heads = (a.num_global_key_value_heads
                           if self.k_eq_v and a.num_global_key_value_heads is not None
                           else a.num_key_value_heads)
        d = a.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        if self.has_kv:
            self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
        if self.has_kv:
            self.k_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
            self.v_norm = ScalelessRMSNorm(a.rms_norm_eps)
        rp = a.rope_parameters.get(self.layer_type, {})
        self.rope = make_rope(self.head_dim, rp.get("rope_theta", 10000.0), a.rope_traditional,
                              rp, a.max_position_embeddings)

    def __call__(self, x, mask, cache, shared):
        """`shared` is the donor's (keys, values, offset, cache) for KV-shared layers.
        Returns (output, (keys, values, offset, cache)) for layers that share ours."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        if shared is not None:
            k, v, offset, kv_cache = shared
        elif not self.has_kv:
            raise ValueError("a KV-shared layer needs its donor's K/V")
        else:
            k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            v = k if self.k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            offset = mx.array(cache.offset) if cache is not None else 0
            k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=offset)
            v = self.v_norm(v).transpose(0, 2, 1, 3)
            kv_cache = cache
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
        q = self.rope(q.transpose(0, 2, 1, 3), offset=offset)
        out = attention(q, k, v, kv_cache, 1.0, mask)
        out = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return out, (k, v, offset, kv_cache)


class Layer(nn.Module):
    def __init__(self, a: Args, idx: int):
        super().__init__()
        self.layer_type = a.layer_types[idx]
        self.self_attn = Attention(a, idx)
        wide = a.use_double_wide_mlp and idx >= a.first_shared > 0
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size * (2 if wide else 1), act=gelu_gate)
        norm = lambda: nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.moe = a.enable_moe_block
        if self.moe:
            gemma4_moe.add_moe(self, a)
        self.per_layer_input = bool(a.hidden_size_per_layer_input)
        if self.per_layer_input:
            self.per_layer_input_gate = nn.Linear(a.hidden_size, a.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(a.hidden_size_per_layer_input, a.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, mask, cache, per_layer_input, shared):
        a, shared = self.self_attn(self.input_layernorm(x), mask, cache, shared)
        h = x + self.post_attention_layernorm(a)
        ff = gemma4_moe.feed_forward(self, h) if self.moe else self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(ff)
        if self.per_layer_input and per_layer_input is not None:
            g = nn.gelu_approx(self.per_layer_input_gate(h))
            g = self.per_layer_projection(mx.multiply(g, per_layer_input))
            h = h + self.post_per_layer_input_norm(g)
        return h * self.layer_scalar, shared


class Backbone(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Layer(a, i) for i in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        if a.hidden_size_per_layer_input:
            n, d = a.num_hidden_layers, a.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(a.vocab_size_per_layer_input, n * d)
            self.per_layer_model_projection = nn.Linear(a.hidden_size, n * d, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(d, eps=a.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: Args):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # donor[i]: whose K/V layer i attends over (itself unless KV-shared)
        n, first = args.num_hidden_layers, args.first_shared
        donor = list(range(n))
        if args.num_kv_shared_layers > 0:
            last_of_type = {args.layer_types[i]: i for i in range(first)}
            for j in range(first, n):
                donor[j] = last_of_type[args.layer_types[j]]
        self._donor = tuple(donor)  # underscore: kept out of the parameter tree

    @property
    def donor(self):
        return self._donor

    @property
    def layers(self):
        return self.model.layers

    def embed(self, inputs):
        return self.model.embed_tokens(inputs) * (self.args.hidden_size ** 0.5)

    def per_layer_inputs(self, inputs, h):
        """[B, T, layers, d_pl] from the token table and the scaled embeddings h."""
        a, m = self.args, self.model
        n, d = a.num_hidden_layers, a.hidden_size_per_layer_input
        tok = m.embed_tokens_per_layer(inputs) * (d ** 0.5)
        tok = mx.unflatten(tok, -1, (n, d))
        proj = m.per_layer_model_projection(h) * (a.hidden_size ** -0.5)
        proj = m.per_layer_projection_norm(mx.unflatten(proj, -1, (n, d)))
        return (proj + tok) * (2.0 ** -0.5)

    def set_media_tokens(self, ids) -> None:
        """Token ids that stand for media (image soft tokens): their per-layer inputs are
        looked up as token 0, as mlx-vlm does."""
        self._media = tuple(int(i) for i in ids)

    @property
    def media_tokens(self) -> tuple:
        return getattr(self, "_media", ())

    def set_image_blocks(self, ids) -> None:
        """`use_bidirectional_attention: "vision"`: in a forward of more than one token from
        empty caches, each run of these tokens (one image's soft tokens) attends to itself in
        both directions, over the causal / sliding-window masks (as mlx-vlm does)."""
        self._blocks = tuple(int(i) for i in ids)

    @property
    def image_blocks(self) -> tuple:
        return getattr(self, "_blocks", ())

    def _overlay_masks(self, inputs, caches) -> Optional[dict]:
        """{layer type: bool mask [B, 1, T, T]} with the image blocks' overlay, or None where
        it does not apply (one token, a cache already holding tokens, no image token)."""
        T = inputs.shape[-1]
        offsets = [getattr(c, "offset", None) for c in caches if c is not None]
        if T < 2 or any(type(o) is not int or o for o in offsets):
            return None
        inside = mx.zeros(inputs.shape, dtype=mx.bool_)
        for t in self.image_blocks:
            inside = inside | (inputs == t)
        if not mx.any(inside).item():
            return None
        before = mx.concatenate([mx.zeros_like(inside[:, :1]), inside[:, :-1]], axis=1)
        run = mx.cumsum((inside & ~before).astype(mx.int32), axis=1)      # 1, 2, ...: the run
        run = mx.where(inside, run, 0)
        same = (run[:, :, None] > 0) & (run[:, :, None] == run[:, None, :])
        q, k = mx.arange(T)[:, None], mx.arange(T)[None]
        out = {}
        for t in set(self.args.layer_types):
            causal = q >= k
            if t == "sliding_attention":
                causal = causal & (q < k + self.args.sliding_window)
            out[t] = mx.expand_dims(causal | same, 1)
        return out

    def begin(self, inputs, cache=None, input_embeddings=None):
        """`input_embeddings` [B, T, D], when given, are the final input embeddings (the
        tokens' already scaled, as `embed` gives them, with any image features in place);
        `inputs` still name the tokens (their per-layer inputs)."""
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        n = len(self.layers)
        caches = [None] * n if cache is None else list(cache) + [None] * (n - len(cache))
        masks, by_type = [], {}
        for layer, c in zip(self.layers, caches):
            t = layer.layer_type
            if t not in by_type:
                window = self.args.sliding_window if t == "sliding_attention" else None
                by_type[t] = attention_mask(h, c, window=window)
            masks.append(by_type[t])
        if self.image_blocks and inputs is not None:
            overlay = self._overlay_masks(inputs, caches)
            if overlay is not None:
                masks = [overlay[layer.layer_type] for layer in self.layers]
        pli = None
        if self.args.hidden_size_per_layer_input:
            ids = inputs
            for t in self.media_tokens:
                ids = mx.where(ids == t, 0, ids)
            pli = self.per_layer_inputs(ids, h)
        return h, {"masks": masks, "caches": caches, "pli": pli, "kv": [None] * n}

    def layer_step(self, i, h, ctx):
        pli = ctx["pli"][:, :, i, :] if ctx["pli"] is not None else None
        d = self.donor[i]
        shared = ctx["kv"][d] if d != i else None
        h, kv = self.layers[i](h, ctx["masks"][i], ctx["caches"][i], pli, shared)
        ctx["kv"][i] = kv
        return h

    def head(self, h):
        h = self.model.norm(h)
        out = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        if self.args.final_logit_softcapping is not None:
            out = softcap(self.args.final_logit_softcapping, out)
        return out

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h, ctx = self.begin(inputs, cache, input_embeddings)
        for i in range(len(self.layers)):
            h = self.layer_step(i, h, ctx)
        return self.head(h)

    def sanitize(self, weights: dict) -> dict:
        first = self.args.first_shared
        out = {}
        for k, v in weights.items():
            if any(s in k for s in ("rotary_emb", "input_max", "input_min", "output_max", "output_min")):
                continue
            if any(s in k for s in (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")):
                try:
                    if int(k.split("layers.")[1].split(".")[0]) >= first:
                        continue  # KV-shared layers' projections are unused
                except (IndexError, ValueError):
                    pass
            experts = gemma4_moe.split_experts(k, v)
            out.update(experts or {k: v})
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def token_split(self, i):
        """Layer i's per-token parts for token-chunked training (engine/models/gemma4_split.py)."""
        from .gemma4_split import token_split
        return token_split(self.layers[i], self.args.sliding_window)

    def quant_predicate(self, path: str, module) -> object:
        return gemma4_moe.quant_predicate(path, module)

    def make_cache(self):
        a = self.args
        return [KVCache() if a.layer_types[i] == "full_attention" else RotatingKVCache(a.sliding_window, keep=0)
                for i in range(a.first_shared)]
