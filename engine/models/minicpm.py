"""MiniCPM (v1-4 `model_type: minicpm`): Llama layout with muP-style scalings.

Embeddings are multiplied by `scale_emb`, each residual branch by
`scale_depth / sqrt(num_layers)`, and an untied head sees the final hidden
state divided by `hidden_size / dim_model_base`.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import llama


@dataclass
class Args(llama.Args):
    dim_model_base: int = 256
    scale_depth: float = 1.0
    scale_emb: float = 1.0
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.rope_theta is None and not self.rope_parameters:
            self.rope_theta = 1000000.0
        super().__post_init__()
        # MiniCPM derives head_dim from hidden / heads; the config's value is ignored.
        self.head_dim = self.hidden_size // self.num_attention_heads


class Block(llama.Block):
    def __init__(self, a: Args):
        super().__init__(a, sliding=False)
        self.branch_scale = a.scale_depth / a.num_hidden_layers ** 0.5

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache) * self.branch_scale
        return h + self.mlp(self.post_attention_layernorm(h)) * self.branch_scale


class Model(llama.Model):
    def __init__(self, args: Args):
        super().__init__(args)
        self.model.layers = [Block(args) for _ in range(args.num_hidden_layers)]

    def embed(self, inputs):
        return self.model.embed_tokens(inputs) * self.args.scale_emb

    def head(self, h):
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h / (self.args.hidden_size / self.args.dim_model_base))

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
