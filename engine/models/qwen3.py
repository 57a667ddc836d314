"""Qwen3 (dense): Llama layout plus RMSNorm on each head's queries and keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Union

import mlx.nn as nn

from . import llama
from .base import attention, rope_and_cache


@dataclass
class Args(llama.Args):
    # Qwen3 checkpoints always carry these; mlx-lm requires them too.
    head_dim: Optional[int] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim is None:
            raise ValueError("qwen3 config needs head_dim")


class Attention(llama.Attention):
    def __init__(self, a: Args):
        super().__init__(a)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)
        out = attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Model(llama.Model):
    attention = Attention
