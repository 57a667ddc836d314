"""Gemma 3 as released (`model_type: gemma3`): the text decoder inside a
multimodal wrapper. The decoder's config is `text_config`; the wrapper's
`vocab_size` (default 262208) replaces the decoder's, and head counts default
to 8 query / 4 key-value heads. Weights are `language_model.*`; the vision
tower and projector are dropped."""

from __future__ import annotations

from . import gemma3_text
from .wrapper import TextWrapper

_TOWERS = ("vision_tower.", "multi_modal_projector.")


def text_args(config: dict) -> gemma3_text.Args:
    text = dict(config.get("text_config") or {})
    text["vocab_size"] = config.get("vocab_size", 262208)
    text.setdefault("num_attention_heads", 8)
    text.setdefault("num_key_value_heads", 4)
    return gemma3_text.Args.from_dict(text)


class Model(TextWrapper):
    def __init__(self, args: gemma3_text.Args):
        super().__init__(gemma3_text.Model(args), "gemma3")

    def sanitize(self, weights: dict) -> dict:
        if not any(k.startswith("language_model.") for k in weights):
            raise ValueError("gemma3 checkpoint has no language_model.* weights")
        inner = {k.removeprefix("language_model."): v for k, v in weights.items()
                 if k.startswith("language_model.")}
        inner = self.language_model.sanitize(inner)
        rest = {k: v for k, v in weights.items()
                if not k.startswith(("language_model.",) + _TOWERS)}
        return {**rest, **{f"language_model.{k}": v for k, v in inner.items()}}
