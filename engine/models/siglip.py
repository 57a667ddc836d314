"""SigLIP's vision encoder (`model_type: siglip_vision_model`), the image tower of Gemma 3.

Patches (a strided convolution) plus learned position embeddings, then pre-norm encoder
layers (LayerNorm, multi-head attention with biases, LayerNorm, a GELU MLP), then a final
LayerNorm. No pooling head (Gemma 3 pools in its projector). Weight names are
`vision_model.*` under the wrapper's `vision_tower.`; the patch convolution is stored
either in MLX's layout [out, kh, kw, in] or PyTorch's [out, in, kh, kw] (`sanitize`).

The MLP's GELU is the tanh approximation (`gelu_pytorch_tanh`, the released configs' one).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

# the keys a checkpoint's vision_config must carry for the tower to be built
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "patch_size")


@dataclass
class VisionArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    image_size: int = 224
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, cfg: dict) -> "VisionArgs":
        return cls(**{k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def complete(cfg) -> bool:
    """Whether a vision_config describes a whole tower (a text-only export may carry a
    stub such as {"model_type": ..., "hidden_size": ...})."""
    return isinstance(cfg, dict) and all(k in cfg for k in REQUIRED)


class Attention(nn.Module):
    def __init__(self, dims: int, heads: int):
        super().__init__()
        if dims % heads:
            raise ValueError(f"vision hidden_size {dims} is not a multiple of its "
                             f"{heads} attention heads")
        self.heads = heads
        self.scale = (dims // heads) ** -0.5
        self.q_proj = nn.Linear(dims, dims, bias=True)
        self.k_proj = nn.Linear(dims, dims, bias=True)
        self.v_proj = nn.Linear(dims, dims, bias=True)
        self.out_proj = nn.Linear(dims, dims, bias=True)

    def __call__(self, x):
        b, n, _ = x.shape

        def split(t):
            return t.reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size, bias=True)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=True)

    def __call__(self, x):
        return self.fc2(nn.gelu_approx(self.fc1(x)))   # gelu_pytorch_tanh


class EncoderLayer(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.self_attn = Attention(a.hidden_size, a.num_attention_heads)
        self.layer_norm1 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.mlp = MLP(a)
        self.layer_norm2 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def __call__(self, x):
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class Encoder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layers = [EncoderLayer(a) for _ in range(a.num_hidden_layers)]


class Embeddings(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.patch_embedding = nn.Conv2d(a.num_channels, a.hidden_size,
                                         kernel_size=a.patch_size, stride=a.patch_size)
        self.position_embedding = nn.Embedding(a.patches_per_side ** 2, a.hidden_size)

    def __call__(self, pixels):                 # [B, H, W, C] -> [B, patches, D]
        x = self.patch_embedding(pixels)
        x = mx.flatten(x, start_axis=1, end_axis=2)
        return x + self.position_embedding.weight[None]


class VisionModel(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.embeddings = Embeddings(a)
        self.encoder = Encoder(a)
        self.post_layernorm = nn.LayerNorm(a.hidden_size)   # (eps 1e-5, as the oracle's)

    def __call__(self, pixels):
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class VisionTower(nn.Module):
    """`vision_tower.vision_model.*`: pixel values [B, H, W, C] -> features [B, patches, D]."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.vision_model = VisionModel(a)

    def __call__(self, pixels):
        return self.vision_model(pixels)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """PyTorch's conv layout [out, in, kh, kw] -> MLX's [out, kh, kw, in]."""
        out = {}
        for k, v in weights.items():
            if k.endswith("patch_embedding.weight") and v.ndim == 4 and v.shape[2] == v.shape[3] \
                    and v.shape[1] != v.shape[2]:
                v = v.transpose(0, 2, 3, 1)
            out[k] = v
        return out
