"""Gemma 3's vision side: the SigLIP tower's features pooled, normalised and projected into
the text decoder's width (`multi_modal_projector.*`), and merged into the prompt's
embeddings at the image tokens.

Shapes: the tower gives (image_size / patch_size)^2 patch features per image; the projector
average-pools them to `mm_tokens_per_image` (a square: 256 on the released models), applies
Gemma's (1 + w) RMSNorm and a plain matrix [vision width, text width]. The merge places
each image's tokens, divided by sqrt(text width) (the decoder multiplies every input
embedding by it), at the prompt's image-token positions in order; the pad token's
positions become zeros (as mlx-vlm 0.7.x merges them)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .gemma3_text import OffsetRMSNorm
from .siglip import VisionArgs


class Projector(nn.Module):
    def __init__(self, vision: VisionArgs, text_width: int, tokens_per_image: int):
        super().__init__()
        side = int(round(tokens_per_image ** 0.5))
        per_side = vision.patches_per_side
        if side * side != tokens_per_image or side == 0 or per_side % side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} must be a square whose "
                             f"side divides the {per_side} patches per side")
        self.per_side = per_side
        self.mm_input_projection_weight = mx.ones((vision.hidden_size, text_width))
        self.mm_soft_emb_norm = OffsetRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        k = per_side // side
        self.avg_pool = nn.AvgPool2d(kernel_size=k, stride=k)

    def __call__(self, feats):                      # [B, patches, Dv] -> [B, tokens, Dt]
        b, _, d = feats.shape
        grid = feats.reshape(b, self.per_side, self.per_side, d)
        pooled = self.avg_pool(grid).reshape(b, -1, d)
        normed = self.mm_soft_emb_norm(pooled)
        return (normed @ self.mm_input_projection_weight).astype(feats.dtype)


def merge(embeds: mx.array, ids: mx.array, features: mx.array, image_token: int,
          pad_token: int, text_width: int) -> mx.array:
    """embeds [1, L, D] (the tokens' own, unscaled), ids [L], features [N, T, D] -> [1, L, D].

    Raises ValueError when the prompt's image tokens are not N * T."""
    flat = features.reshape(-1, features.shape[-1]) / (text_width ** 0.5)
    is_image = ids == image_token
    n = int(is_image.sum().item())
    if n != flat.shape[0]:
        raise ValueError(f"the prompt has {n} image tokens for {features.shape[0]} image(s) "
                         f"of {features.shape[1]} tokens each")
    keep = (~is_image) & (ids != pad_token)
    out = mx.where(keep[None, :, None], embeds, mx.zeros(embeds.shape, mx.float32))
    # the k-th image token takes the k-th feature row
    order = mx.cumsum(is_image.astype(mx.int32)) - 1
    rows = flat[mx.maximum(order, 0)].astype(mx.float32)
    out = mx.where(is_image[None, :, None], rows[None], out)
    return out.astype(embeds.dtype)
