"""A multimodal checkpoint's text decoder behind its wrapper (`language_model`)."""

from __future__ import annotations

import mlx.nn as nn


class TextWrapper(nn.Module):
    """Holds `language_model` and forwards the decoder's interface to it
    (forward, the begin / layer_step / head segment protocol, caches)."""

    def __init__(self, decoder: nn.Module, model_type: str):
        super().__init__()
        self.args = decoder.args
        self.model_type = model_type
        self.language_model = decoder

    @property
    def layers(self):
        return self.language_model.layers

    def begin(self, inputs, cache=None, input_embeddings=None):
        return self.language_model.begin(inputs, cache, input_embeddings)

    def layer_step(self, i, h, ctx):
        return self.language_model.layer_step(i, h, ctx)

    def head(self, h):
        return self.language_model.head(h)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.language_model(inputs, cache=cache, input_embeddings=input_embeddings)

    def make_cache(self):
        return self.language_model.make_cache()
