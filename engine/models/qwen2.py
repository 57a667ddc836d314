"""Qwen2 / Qwen2.5 (`model_type: qwen2`): the Llama layout with biases on the
query, key and value projections (none on the output projection).

The head dim is always `hidden_size / num_attention_heads` (a config
`head_dim` is ignored, as in the reference implementation); RoPE theta
defaults to 1e6; embeddings are tied unless the config says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from . import llama


@dataclass
class Args(llama.Args):
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.attention_bias = True   # q/k/v only; o_proj is rebuilt without bias below
        self.mlp_bias = False
        # The reference ignores sliding-window settings: every layer attends fully.
        self.layer_types = ["full_attention"] * self.num_hidden_layers


class Model(llama.Model):
    def __init__(self, args: Args):
        super().__init__(args)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.o_proj = nn.Linear(attn.n_heads * attn.head_dim, args.hidden_size, bias=False)
