"""Gemma 4 as released (`model_type: gemma4`): the text decoder inside a
multimodal wrapper. Config nests the decoder under `text_config`; HF weights
are named `model.language_model.*` (vision/audio towers are dropped).
The encoder-free `gemma4_unified` checkpoints load through the same wrapper
(their `vision_embedder.*` weights are dropped until vision exists)."""

from __future__ import annotations

from . import gemma4_text
from .wrapper import TextWrapper

_TOWERS = ("vision_tower", "multi_modal_projector", "audio_tower", "embed_audio",
           "embed_vision", "vision_embedder")


def text_args(config: dict) -> gemma4_text.Args:
    text = dict(config.get("text_config") or {})
    # The decoder's own vocab_size wins; the wrapper's is a fallback.
    if "vocab_size" not in text and "vocab_size" in config:
        text["vocab_size"] = config["vocab_size"]
    text.setdefault("num_attention_heads", 8)
    text.setdefault("num_key_value_heads", 1)
    if "quantization" in config:
        text["quantization"] = config["quantization"]
    return gemma4_text.Args.from_dict(text)


class Model(TextWrapper):
    def __init__(self, args: gemma4_text.Args):
        super().__init__(gemma4_text.Model(args), "gemma4")

    @property
    def donor(self):
        return self.language_model.donor

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for k, v in weights.items():
            hf = k.startswith("model.")
            k = k.removeprefix("model.")
            if k.startswith(_TOWERS):
                continue
            if hf and k.startswith("language_model."):
                k = k.replace("language_model.", "language_model.model.", 1)
            out[k] = v
        inner = {k.removeprefix("language_model."): v for k, v in out.items()
                 if k.startswith("language_model.")}
        inner = self.language_model.sanitize(inner)
        return {f"language_model.{k}": v for k, v in inner.items()}

    def token_split(self, i):
        return self.language_model.token_split(i)

    def quant_predicate(self, path: str, module) -> object:
        return self.language_model.quant_predicate(path, module)

