"""Gemma 3 as released (`model_type: gemma3`): the text decoder inside a
multimodal wrapper. The decoder's config is `text_config`; the wrapper's
`vocab_size` (default 262208) replaces the decoder's, and head counts default
to 8 query / 4 key-value heads. Weights are `language_model.*`.

With a whole `vision_config` (`siglip.complete`) the SigLIP tower (`vision_tower.*`) and the
projector (`multi_modal_projector.*`, `gemma3_vision`) are built and loaded, and
`Model.vision` describes them for the image path (`engine.vision`); a checkpoint whose
vision_config is a stub is text-only and its tower weights are dropped."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import gemma3_text, gemma3_vision, siglip
from .wrapper import TextWrapper

_TOWERS = ("vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class VisionInfo:
    """What the image path needs to know of a model with a vision tower."""
    kind: str                 # the preprocessing family ("gemma3")
    image_size: int           # square input side, pixels
    tokens_per_image: int     # image tokens one image becomes
    image_token_id: int
    boi_token_id: int         # the marker the chat template emits for an image part
    eoi_token_id: int
    pad_token_id: int


def text_args(config: dict) -> gemma3_text.Args:
    text = dict(config.get("text_config") or {})
    text["vocab_size"] = config.get("vocab_size", 262208)
    text.setdefault("num_attention_heads", 8)
    text.setdefault("num_key_value_heads", 4)
    return gemma3_text.Args.from_dict(text)


def _tokens_per_image(config: dict) -> int:
    text = config.get("text_config") or {}
    return int(config.get("mm_tokens_per_image", text.get("mm_tokens_per_image", 256)))


class Model(TextWrapper):
    def __init__(self, args: gemma3_text.Args, config: dict | None = None):
        super().__init__(gemma3_text.Model(args), "gemma3")
        config = config or {}
        self.vision = None
        vcfg = config.get("vision_config")
        if siglip.complete(vcfg):
            va = siglip.VisionArgs.from_dict(vcfg)
            tokens = _tokens_per_image(config)
            self.vision_tower = siglip.VisionTower(va)
            self.multi_modal_projector = gemma3_vision.Projector(va, args.hidden_size, tokens)
            self.vision = VisionInfo("gemma3", va.image_size, tokens,
                                     int(config.get("image_token_index", 262144)),
                                     int(config.get("boi_token_index", 255999)),
                                     int(config.get("eoi_token_index", 256000)),
                                     int(config.get("pad_token_id", 0) or 0))

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(text_args(config), config)

    def image_features(self, pixels: mx.array, dtype) -> mx.array:
        """pixel values [N, C, H, W] (float32, preprocessed) -> [N, tokens, text width]."""
        feats = self.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype))
        return self.multi_modal_projector(feats)

    def token_embeddings(self, tokens: mx.array) -> mx.array:
        """The tokens' own input embeddings [B, T] -> [B, T, D], unscaled (what
        `begin(..., input_embeddings=)` takes: it scales them as it scales the tokens')."""
        return self.language_model.model.embed_tokens(tokens)

    def embed_prompt(self, ids: list, pixels: mx.array) -> mx.array:
        """The prompt's input embeddings [1, L, D] with the images' features at their
        tokens (what `begin(..., input_embeddings=)` takes)."""
        tokens = mx.array(ids)
        embeds = self.token_embeddings(tokens[None])
        feats = self.image_features(pixels, embeds.dtype)
        return gemma3_vision.merge(embeds, tokens, feats, self.vision.image_token_id,
                                   self.vision.pad_token_id, self.args.hidden_size)

    def sanitize(self, weights: dict) -> dict:
        if not any(k.startswith("language_model.") for k in weights):
            raise ValueError("gemma3 checkpoint has no language_model.* weights")
        inner = {k.removeprefix("language_model."): v for k, v in weights.items()
                 if k.startswith("language_model.")}
        inner = self.language_model.sanitize(inner)
        drop = ("language_model.",) + (_TOWERS if self.vision is None else ())
        rest = {k: v for k, v in weights.items() if not k.startswith(drop)}
        if self.vision is not None:
            rest = siglip.VisionTower.sanitize(rest)
        return {**rest, **{f"language_model.{k}": v for k, v in inner.items()}}
