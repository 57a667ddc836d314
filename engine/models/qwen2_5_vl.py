"""Qwen2.5-VL (`model_type: qwen2_5_vl`): a Qwen2 text decoder with multimodal rotary
positions (M-RoPE) and the vision tower of `qwen2_5_vl_vision`.

The text decoder's config is the top level of config.json (HF's layout; a `text_config`,
where present, is merged over it). Weights: `language_model.*` and `vision_tower.*`
(mlx-vlm's layout) or HF's `model.*` / `lm_head.*` / `visual.*`.

**M-RoPE.** Every token has three positions (temporal, height, width); the rotary
frequencies of a head are cut into `rope_scaling.mrope_section` = [s_t, s_h, s_w] chunks
(s_t + s_h + s_w = head_dim / 2), chunk i rotating by position i. A text token's three
positions are equal (plain RoPE); an image's tokens share one temporal position and take
their row and column in the merged grid, offset past the text before them; the text after
an image continues from the largest position so far + 1 (`prompt_positions`). After the
prompt, token n sits at n + delta, delta = (largest prompt position + 1) - prompt length.
The angles are computed as `x cos + rotate_half(x) sin` with cos / sin in the activation
dtype (what mlx-vlm computes when it has no Metal kernel for it, i.e. on the CPU).

A request's positions travel with its caches: `bind_positions(caches, ids, grids)` puts
them on the first layer's cache (`caches[0].mrope`); a forward over tokens [o, o + T)
takes the prompt's table there, past it o + delta. Caches without them (a text-only
prompt) use o + arange(T) (delta 0). A batch cache (one offset per row, left padding not
counted) takes its rows' own positions from `row_positions` (a list: each row's `Positions`
or None for a text row; the batch runner sets it before each forward): row b's tokens
[o_b, o_b + T) then sit where they sit alone (`row_positions` below)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import qwen2_5_vl_vision as vt
from .base import GatedMLP, attention, attention_mask
from .wrapper import TextWrapper
from engine.kv.cache import KVCache

_TOWER = ("vision_tower.", "visual.")


@dataclass
class TextArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    rope_theta: float
    mrope_section: tuple
    tie_word_embeddings: bool
    max_position_embeddings: int = 128000
    model_type: str = "qwen2_5_vl"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def text_args(config: dict) -> TextArgs:
    c = {**config, **(config.get("text_config") or {})}
    scaling = c.get("rope_scaling") or c.get("rope_parameters") or {}
    heads = c["num_attention_heads"]
    return TextArgs(
        hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"],
        intermediate_size=c["intermediate_size"], num_attention_heads=heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), vocab_size=c["vocab_size"],
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        rope_theta=float(c.get("rope_theta", scaling.get("rope_theta", 1000000.0))),
        mrope_section=tuple(scaling.get("mrope_section") or (16, 24, 24)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        max_position_embeddings=int(c.get("max_position_embeddings") or 128000))


@dataclass(frozen=True)
class VisionInfo:
    """What the image path needs to know of a model with a vision tower."""
    kind: str                     # the preprocessing family ("qwen2_5_vl")
    image_token_id: int           # <|image_pad|>
    vision_start_token_id: int    # <|vision_start|> (the token before an image's tokens)
    merge_size: int
    tokens_per_image: int = 0     # 0: it depends on the image's size
    pad_token_id: int = -1


@dataclass
class Positions:
    """A prompt's M-RoPE positions: table [3, L] (int) and the delta after it."""
    table: np.ndarray
    delta: int


def prompt_positions(ids: list, image_token: int, grids: list, merge: int) -> Positions:
    """The three positions of every prompt token: text counts on from the largest position
    so far; the k-th run of image tokens takes grids[k]'s (t, row, col) after it."""
    cols, at, nxt = [], 0, 0
    for t, h, w in grids:
        start = ids.index(image_token, at)
        n = start - at
        cols.append(np.broadcast_to(np.arange(n) + nxt, (3, n)))
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        cols.append(np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + nxt + n)
        nxt = int(cols[-1].max()) + 1
        at = start + t * gh * gw
    n = len(ids) - at
    cols.append(np.broadcast_to(np.arange(n) + nxt, (3, n)))
    table = np.concatenate(cols, axis=1).astype(np.int32)
    return Positions(table, int(table.max()) + 1 - len(ids))


def row_positions(pos: Optional[Positions], offset: int, L: int) -> np.ndarray:
    """[3, L] positions of tokens [offset, offset + L) of one sequence: its prompt's table
    inside the prompt, index + delta after it; plain (index on all three axes) without
    `pos` (a text-only sequence) and at negative indices (padding)."""
    idx = np.arange(offset, offset + L)
    p = np.array(np.broadcast_to(idx, (3, L)))
    if pos is not None:
        n = pos.table.shape[1]
        inside = (idx >= 0) & (idx < n)
        p[:, inside] = pos.table[:, idx[inside]]
        p[:, idx >= n] += pos.delta
    return p


def _rotate_half(x):
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Module):
    def __init__(self, a: TextArgs):
        super().__init__()
        d, hd = a.hidden_size, a.head_dim
        self.n_heads, self.n_kv_heads = a.num_attention_heads, a.num_key_value_heads
        self.head_dim = hd
        self.scale = hd ** -0.5
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def __call__(self, x, mask, cache, cos, sin):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = (q * cos + _rotate_half(q) * sin).astype(q.dtype)
        k = (k * cos + _rotate_half(k) * sin).astype(k.dtype)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Block(nn.Module):
    def __init__(self, a: TextArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)

    def __call__(self, x, mask, cache, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, a: TextArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Block(a) for _ in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)


class TextModel(nn.Module):
    """The decoder (`begin` / `layer_step` / `head` as the other families)."""

    def __init__(self, args: TextArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        hd = args.head_dim
        self._inv_freq = 1.0 / (args.rope_theta ** (mx.arange(0, hd, 2).astype(mx.float32) / hd))
        sel, at = [0] * (hd // 2), 0
        for axis, n in enumerate(args.mrope_section):
            for j in range(at, min(at + n, hd // 2)):
                sel[j] = axis
            at += n
        self._freq_axis = mx.array(sel, mx.int32)   # the position (t, h, w) each frequency follows

    @property
    def layers(self):
        return self.model.layers

    def positions(self, cache, B: int, L: int) -> mx.array:
        """[3, B, L] int positions of a forward of L tokens on `cache` (layer 0's)."""
        offset = cache.offset if cache is not None else 0
        if isinstance(offset, mx.array):        # a batch cache: one offset per row
            rows = getattr(cache, "row_positions", None)
            if rows is None or all(r is None for r in rows):
                p = offset.reshape(-1, 1).astype(mx.int32) + mx.arange(L, dtype=mx.int32)
                return mx.broadcast_to(p[None], (3, p.shape[0], L))
            p = np.stack([row_positions(r, o, L) for r, o in zip(rows, offset.tolist())], 1)
            return mx.array(p.astype(np.int32))
        p = row_positions(getattr(cache, "mrope", None), offset, L)
        return mx.broadcast_to(mx.array(p.astype(np.int32))[:, None], (3, B, L))

    def rope(self, positions: mx.array, dtype) -> tuple:
        """cos, sin [B, 1, L, head_dim] in `dtype` for positions [3, B, L]."""
        p = mx.take(positions, self._freq_axis, axis=0).transpose(1, 2, 0)     # [B, L, hd/2]
        freqs = p.astype(mx.float32) * self._inv_freq
        emb = mx.concatenate([freqs, freqs], axis=-1)
        return (mx.cos(emb).astype(dtype)[:, None], mx.sin(emb).astype(dtype)[:, None])

    def embed(self, inputs):
        return self.model.embed_tokens(inputs)

    def begin(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed(inputs)
        caches = cache if cache is not None else [None] * len(self.layers)
        cos, sin = self.rope(self.positions(caches[0], h.shape[0], h.shape[1]), h.dtype)
        return h, {"mask": attention_mask(h, caches[0]), "caches": caches, "cos": cos, "sin": sin}

    def layer_step(self, i, h, ctx):
        return self.layers[i](h, ctx["mask"], ctx["caches"][i], ctx["cos"], ctx["sin"])

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
        return [KVCache() for _ in self.layers]


class Model(TextWrapper):
    """The decoder behind `language_model`, the tower as `vision_tower`."""

    def __init__(self, args: TextArgs, config: dict | None = None):
        super().__init__(TextModel(args), "qwen2_5_vl")
        config = config or {}
        self.vision = None
        vcfg = config.get("vision_config")
        if vcfg:
            va = vt.VisionArgs.from_dict(vcfg)
            self.vision_tower = vt.VisionTower(va)
            self.vision = VisionInfo("qwen2_5_vl", int(config.get("image_token_id", 151655)),
                                     int(config.get("vision_start_token_id", 151652)),
                                     va.spatial_merge_size)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(text_args(config), config)

    def image_features(self, pixels: mx.array, grids: list) -> mx.array:
        """pixel values [N, C*T*P*P] of all images, their grids -> [tokens, text width]."""
        dtype = self.vision_tower.patch_embed.proj.weight.dtype
        return self.vision_tower(pixels.astype(dtype), grids)

    def token_embeddings(self, tokens: mx.array) -> mx.array:
        return self.language_model.model.embed_tokens(tokens)

    def embed_prompt(self, ids: list, pixels: mx.array, grids: list) -> mx.array:
        """The prompt's input embeddings [1, L, D], the images' tokens at `<|image_pad|>`."""
        tokens = mx.array(ids)
        embeds = self.token_embeddings(tokens[None])
        feats = self.image_features(pixels, grids)
        is_image = tokens == self.vision.image_token_id
        n = int(is_image.sum().item())
        if n != feats.shape[0]:
            raise ValueError(f"the prompt has {n} image tokens for {feats.shape[0]} image features")
        rows = feats[mx.maximum(mx.cumsum(is_image.astype(mx.int32)) - 1, 0)]
        return mx.where(is_image[:, None], rows, embeds[0])[None]

    def image_positions(self, ids: list, grids: list) -> Positions:
        """The M-RoPE positions of a prompt with images (a batch row's `positions`)."""
        return prompt_positions(ids, self.vision.image_token_id, grids, self.vision.merge_size)

    def bind_positions(self, caches: list, ids: list, grids: list) -> None:
        """Put the prompt's M-RoPE positions on the request's caches (before its prefill)."""
        caches[0].mrope = self.image_positions(ids, grids)

    def sanitize(self, weights: dict) -> dict:
        inner, rest = {}, {}
        for k, v in weights.items():
            if k.startswith("model.language_model."):          # HF's newer names
                k = "language_model.model." + k[len("model.language_model."):]
            elif k.startswith("model.visual."):
                k = k[len("model."):]
            if k.startswith("language_model."):
                inner[k[len("language_model."):]] = v
            elif k.startswith(("model.", "lm_head.")):          # HF's older names
                inner[k] = v
            else:
                rest[k] = v
        inner = self.language_model.sanitize(inner)
        rest = vt.VisionTower.sanitize(rest)
        if self.vision is None:
            rest = {k: v for k, v in rest.items() if not k.startswith(_TOWER)}
        return {**rest, **{f"language_model.{k}": v for k, v in inner.items()}}
