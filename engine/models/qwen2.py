"""Qwen2 / Qwen2.5 (`model_type: qwen2`): the Llama layout with biases on the
query, key and value projections (none on the output projection).

The head dim is always `hidden_size / num_attention_heads` (a config
`head_dim` is ignored, as in the reference implementation); RoPE theta
defaults to 1e6; embeddings are tied unless the config says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass


from . import llama


@dataclass
class Args(llama.Args):
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.attention_bias = True   # q/k/v only (Attention: o_proj without)
        self.mlp_bias = False
        # The reference ignores sliding-window settings: every layer attends fully.
        self.layer_types = ["full_attention"] * self.num_hidden_layers


class Attention(llama.Attention):
    def __init__(self, a: Args):
        super().__init__(a, o_bias=False)


class Model(llama.Model):
    attention = Attention
