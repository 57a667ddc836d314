"""Gemma 4's vision tower (`vision_tower.*`) and its projection into the text decoder
(`embed_vision.*`), in mlx-vlm's weight layout.

Per image: patches (`engine.vision.gemma4.to_patches`: [N, p*p*3], values in [0, 1]) are
mapped to [-1, 1] and projected (`patch_embedder.input_proj`, no bias); each patch adds the
rows of `position_embedding_table` [2, P, D] at its column and its row. Then
`num_hidden_layers` blocks: RMSNorm (weight used as is) -> attention -> RMSNorm, residual;
RMSNorm -> gated GELU (tanh) MLP -> RMSNorm, residual. Attention is bidirectional over the
image's patches, scale 1: q and k get a scaled RMSNorm over the head, v one without
scale, then a 2-D rotary embedding (the head's first half rotated by the patch's column,
the second half by its row, each half-split as rotate_half, base `rope_theta`). Projections
may clip their input and output (`use_clipped_linears`: `input_min/max`, `output_min/max`).
Pooling averages k x k patches (k = `pooling_kernel_size`) into one soft token, times
sqrt(width); optionally standardised (`std_bias`, `std_scale`). `embed_vision`: RMSNorm
without scale, then a matrix to the text width. The soft tokens replace the prompt's image
tokens unscaled (the text tokens' embeddings are scaled by sqrt(text width))."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size",
            "intermediate_size")


def complete(cfg) -> bool:
    """Whether a vision_config describes a whole tower (not a stub)."""
    return isinstance(cfg, dict) and all(k in cfg for k in REQUIRED)


@dataclass
class VisionArgs:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    patch_size: int = 16
    position_embedding_size: int = 10240
    pooling_kernel_size: int = 3
    default_output_length: int = 280
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 100.0})

    @classmethod
    def from_dict(cls, d: dict) -> "VisionArgs":
        names = cls.__dataclass_fields__
        out = cls(**{k: v for k, v in d.items() if k in names and v is not None})
        if "num_key_value_heads" not in d:
            out.num_key_value_heads = out.num_attention_heads
        return out


class Projection(nn.Module):
    """A bias-free matrix, its input and output clipped when `clip` (`linear.weight`)."""

    def __init__(self, fan_in: int, fan_out: int, clip: bool):
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        self.clip = clip
        if clip:
            self.input_min = mx.array(-float("inf"))
            self.input_max = mx.array(float("inf"))
            self.output_min = mx.array(-float("inf"))
            self.output_max = mx.array(float("inf"))

    def __call__(self, x):
        if not self.clip:
            return self.linear(x)
        y = self.linear(mx.clip(x, self.input_min, self.input_max))
        return mx.clip(y, self.output_min, self.output_max)


def head_norm(x, weight, eps):
    """RMSNorm over the last axis in float32 (times `weight` when given)."""
    f = x.astype(mx.float32)
    f = f * mx.rsqrt(mx.mean(f * f, axis=-1, keepdims=True) + eps)
    if weight is not None:
        f = f * weight.astype(mx.float32)
    return f.astype(x.dtype)


def rope_2d(x, pos, base):
    """x [B, L, H, hd], pos [B, L, 2] (column, row): each half of the head rotated by one."""
    hd = x.shape[-1]
    part = 2 * (hd // 4)
    half = part // 2
    inv = mx.power(base, (2.0 / part) * mx.arange(0, half).astype(mx.float32))
    out = []
    for d in range(2):
        xp = x[..., d * part:(d + 1) * part]
        ang = pos[..., d:d + 1].astype(mx.float32) / inv
        cos = mx.concatenate([mx.cos(ang)] * 2, axis=-1).astype(x.dtype)[:, :, None]
        sin = mx.concatenate([mx.sin(ang)] * 2, axis=-1).astype(x.dtype)[:, :, None]
        rot = mx.concatenate([-xp[..., half:], xp[..., :half]], axis=-1)
        out.append(xp * cos + rot * sin)
    return mx.concatenate(out, axis=-1)


class Attention(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.heads, self.kv_heads, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.base = float(a.rope_parameters.get("rope_theta", 100.0))
        c, d = a.use_clipped_linears, a.hidden_size
        self.q_proj = Projection(d, self.heads * self.hd, c)
        self.k_proj = Projection(d, self.kv_heads * self.hd, c)
        self.v_proj = Projection(d, self.kv_heads * self.hd, c)
        self.o_proj = Projection(self.heads * self.hd, d, c)
        self.q_norm = nn.RMSNorm(self.hd)          # (weights only: applied by head_norm)
        self.k_norm = nn.RMSNorm(self.hd)

    def __call__(self, x, pos, mask):
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.heads, self.hd)
        k = self.k_proj(x).reshape(b, n, self.kv_heads, self.hd)
        v = self.v_proj(x).reshape(b, n, self.kv_heads, self.hd)
        q = rope_2d(head_norm(q, self.q_norm.weight, 1e-6), pos, self.base)
        k = rope_2d(head_norm(k, self.k_norm.weight, 1e-6), pos, self.base)
        v = head_norm(v, None, 1e-6)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        pad = next((t for t in (64, 80, 128) if self.hd <= t), self.hd) - self.hd
        if pad:      # the fused kernel's head sizes (zeros change no score)
            w = [(0, 0)] * 3 + [(0, pad)]
            q, k, v = mx.pad(q, w), mx.pad(k, w), mx.pad(v, w)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)[..., :self.hd]
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        c = a.use_clipped_linears
        self.gate_proj = Projection(a.hidden_size, a.intermediate_size, c)
        self.up_proj = Projection(a.hidden_size, a.intermediate_size, c)
        self.down_proj = Projection(a.intermediate_size, a.hidden_size, c)

    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.eps = a.rms_norm_eps
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            setattr(self, name, nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps))

    def __call__(self, x, pos, mask):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), pos, mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class PatchEmbedder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.input_proj = nn.Linear(3 * a.patch_size ** 2, a.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, a.position_embedding_size, a.hidden_size))

    def __call__(self, patches, pos):
        h = self.input_proj((2 * (patches - 0.5)).astype(self.input_proj.weight.dtype))
        t = self.position_embedding_table
        return h + (t[0][pos[..., 0]] + t[1][pos[..., 1]])


class Encoder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layers = [Block(a) for _ in range(a.num_hidden_layers)]


class VisionTower(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.patch_embedder = PatchEmbedder(a)
        self.encoder = Encoder(a)
        if a.standardize:
            self.std_bias = mx.zeros((a.hidden_size,))
            self.std_scale = mx.ones((a.hidden_size,))

    def __call__(self, patches: mx.array, rows: int, cols: int) -> mx.array:
        """One image's patches [rows * cols, p*p*3] (float32) -> soft tokens [T, width]."""
        k = self.args.pooling_kernel_size
        if rows % k or cols % k:
            raise ValueError(f"a {rows} x {cols} patch grid does not pool by {k}")
        gy, gx = mx.meshgrid(mx.arange(rows), mx.arange(cols), indexing="ij")
        pos = mx.stack([gx.reshape(-1), gy.reshape(-1)], axis=-1)[None].astype(mx.int32)
        h = self.patch_embedder(patches[None], pos)
        mask = mx.zeros((1, 1, h.shape[1], h.shape[1]), h.dtype)
        for layer in self.encoder.layers:
            h = layer(h, pos, mask)
        out = pool(h[0], rows, cols, k) * (self.args.hidden_size ** 0.5)
        if self.args.standardize:
            out = (out - self.std_bias) * self.std_scale
        return out


def pool(h: mx.array, rows: int, cols: int, k: int) -> mx.array:
    """[rows * cols, D] -> [(rows / k) * (cols / k), D]: the mean of each k x k block (in
    float32, as a matrix of weights 1 / k^2 over the patches), blocks in row-major order."""
    gy, gx = mx.meshgrid(mx.arange(rows), mx.arange(cols), indexing="ij")
    block = (gy // k) * (cols // k) + gx // k
    n = (rows // k) * (cols // k)
    weights = (block.reshape(-1)[:, None] == mx.arange(n)).astype(mx.float32) / (k * k)
    return mx.einsum("Ll,Ld->ld", weights, h).astype(h.dtype)


class Embedder(nn.Module):
    """`embed_vision`: RMSNorm without scale, then `embedding_projection` to the text width."""

    def __init__(self, width: int, text_width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(width, text_width, bias=False)

    def __call__(self, x):
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))


def merge(embeds: mx.array, ids: mx.array, features: mx.array, image_token: int) -> mx.array:
    """embeds [1, L, D] (the tokens' scaled embeddings), ids [L], features [N, D] ->
    [1, L, D]: the k-th image token takes the k-th feature row.

    Raises ValueError when the prompt's image tokens are not N."""
    is_image = ids == image_token
    n = int(is_image.sum().item())
    if n != features.shape[0]:
        raise ValueError(f"the prompt has {n} image tokens for {features.shape[0]} soft tokens")
    order = mx.maximum(mx.cumsum(is_image.astype(mx.int32)) - 1, 0)
    rows = features.astype(embeds.dtype)[order]
    return mx.where(is_image[None, :, None], rows[None], embeds)


def sanitize(weights: dict, clip: bool) -> dict:
    """The tower's and embedder's weights; clip bounds dropped unless the tower clips."""
    bounds = ("input_min", "input_max", "output_min", "output_max")
    return {k: v for k, v in weights.items()
            if clip or not k.endswith(bounds)}
