"""The encoder-free image embedder of `gemma4_unified` checkpoints (`vision_embedder.*`),
in mlx-vlm's weight layout.

Per image: the patches (`engine.vision.gemma4.Gemma4UnifiedPreprocess`: [N, m*m*3] with m
the model patch size, values in [0, 1], one patch per soft token) go through
LayerNorm (`patch_ln1`) -> a matrix with bias (`patch_dense`) -> LayerNorm (`patch_ln2`);
each patch adds the rows of `pos_embedding` [P, 2, D] at (its column, 0) and (its row, 1);
then a LayerNorm (`pos_norm`). The result goes through `embed_vision` (RMSNorm without
scale, a matrix to the text width), as the Gemma 4 tower's soft tokens do. There is no
tower: no attention, no pooling."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class UnifiedVisionArgs:
    patch_size: int = 16
    pooling_kernel_size: int = 3
    model_patch_size: int = 48
    mm_embed_dim: int = 3840
    mm_posemb_size: int = 1120
    num_soft_tokens: int = 280
    rms_norm_eps: float = 1e-6
    output_proj_dims: int = 3840

    @classmethod
    def from_dict(cls, d: dict) -> "UnifiedVisionArgs":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    def check(self) -> None:
        """ValueError when the config cannot be served as mlx-vlm runs it."""
        if self.model_patch_size != self.patch_size * self.pooling_kernel_size:
            raise ValueError(f"model_patch_size {self.model_patch_size} is not patch_size * "
                             f"pooling_kernel_size ({self.patch_size * self.pooling_kernel_size})")
        if self.mm_embed_dim != self.output_proj_dims:
            raise ValueError(f"mm_embed_dim {self.mm_embed_dim} != output_proj_dims "
                             f"{self.output_proj_dims}")


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (eps 1e-5), over the last axis."""

    def __init__(self, dims: int):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.bias = mx.zeros((dims,))

    def __call__(self, x):
        return mx.fast.layer_norm(x, self.weight, self.bias, 1e-5)


class VisionEmbedder(nn.Module):
    def __init__(self, a: UnifiedVisionArgs):
        super().__init__()
        self.args = a
        dim = 3 * a.model_patch_size ** 2
        self.patch_ln1 = LayerNorm(dim)
        self.patch_dense = nn.Linear(dim, a.mm_embed_dim)
        self.patch_ln2 = LayerNorm(a.mm_embed_dim)
        self.pos_embedding = mx.zeros((a.mm_posemb_size, 2, a.mm_embed_dim))
        self.pos_norm = LayerNorm(a.mm_embed_dim)

    def __call__(self, patches: mx.array, rows: int, cols: int) -> mx.array:
        """One image's patches [rows * cols, m*m*3] (float32, row-major) -> [rows * cols, D]."""
        if max(rows, cols) > self.args.mm_posemb_size:
            raise ValueError(f"a {rows} x {cols} patch grid exceeds the {self.args.mm_posemb_size}"
                             " position embeddings")
        h = self.patch_ln2(self.patch_dense(self.patch_ln1(patches)))
        gy, gx = mx.meshgrid(mx.arange(rows), mx.arange(cols), indexing="ij")
        table, one = self.pos_embedding, mx.ones((1, 1), h.dtype)    # (the oracle's mask)
        return self.pos_norm(h + (table[gx.reshape(-1), 0] * one + table[gy.reshape(-1), 1] * one))
