"""Gemma 4 as released (`model_type: gemma4`): the text decoder inside a
multimodal wrapper. Config nests the decoder under `text_config`; HF weights
are named `model.language_model.*`. With a whole `vision_config`
(`gemma4_vision.complete`) the vision tower (`vision_tower.*`) and its projection
(`embed_vision.*`) are built and loaded and `Model.vision` describes them for the image
path (`engine.vision`); otherwise (a stub vision_config) they are dropped, as the audio
tower always is. The encoder-free `gemma4_unified` checkpoints load through the same
wrapper; with a `vision_config` their `vision_embedder.*` (`gemma4_unified_vision`) and
`embed_vision.*` take the tower's place (dropped when the weights lack them)."""

from __future__ import annotations

import mlx.core as mx

from . import gemma4_text, gemma4_unified_vision, gemma4_vision
from .gemma3 import VisionInfo
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
    whole_image_prompts = False   # True: a prompt with images is prefilled in one forward
    def __init__(self, args: gemma4_text.Args, config: dict | None = None):
        super().__init__(gemma4_text.Model(args), "gemma4")
        config = config or {}
        self.vision = None
        vcfg = config.get("vision_config")
        kind = config.get("model_type", "gemma4")
        unified = kind == "gemma4_unified" and isinstance(vcfg, dict)
        problem = None
        if unified:
            ua = gemma4_unified_vision.UnifiedVisionArgs.from_dict(vcfg)
            try:
                ua.check()
            except ValueError as e:
                problem = f"image inputs are not supported for this checkpoint: {e}"
            self.vision_embedder = gemma4_unified_vision.VisionEmbedder(ua)
            self.embed_vision = gemma4_vision.Embedder(ua.output_proj_dims, args.hidden_size,
                                                       ua.rms_norm_eps)
        elif kind == "gemma4" and gemma4_vision.complete(vcfg):
            va = gemma4_vision.VisionArgs.from_dict(vcfg)
            self.vision_tower = gemma4_vision.VisionTower(va)
            self.embed_vision = gemma4_vision.Embedder(va.hidden_size, args.hidden_size,
                                                       va.rms_norm_eps)
        if unified or (kind == "gemma4" and gemma4_vision.complete(vcfg)):
            image = int(config.get("image_token_id", 258880))
            # tokens_per_image 0: the count depends on the image's size
            marks = [config.get(k, d) for k, d in (("boi_token_id", 255999),
                                                    ("eoi_token_id", 258882))]
            marks = [-1 if m is None else int(m) for m in marks]    # -1: none
            self.vision = VisionInfo("gemma4", 0, 0, image, marks[0], marks[1],
                                     int(config.get("pad_token_id", 0) or 0))
            media = [image] + [int(config[k]) for k in ("audio_token_id", "video_token_id")
                               if config.get(k) is not None]
            self.language_model.set_media_tokens(media)
            text = config.get("text_config") or {}
            default = "vision" if unified else None        # (mlx-vlm's default for each)
            if text.get("use_bidirectional_attention", default) == "vision":
                # an image's tokens attend to each other both ways in the prompt's forward,
                # which therefore runs whole (`whole_image_prompts`: engine.step.alone)
                video = config.get("video_token_id")
                self.language_model.set_image_blocks([image] + ([] if video is None
                                                                else [int(video)]))
                self.whole_image_prompts = True
            if problem:
                self.vision_refused = problem

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(text_args(config), config)

    def image_features(self, patches: mx.array, grids: list) -> mx.array:
        """All images' patches [sum of rows * cols, p*p*3] (float32, in [0, 1]) and their
        grids (1, rows, cols) -> soft tokens [tokens, text width], image by image."""
        out, at = [], 0
        if "vision_embedder" in self:          # gemma4_unified: one patch per soft token
            for _, rows, cols in grids:
                n = rows * cols
                out.append(self.embed_vision(self.vision_embedder(patches[at:at + n], rows, cols)))
                at += n
            return mx.concatenate(out, axis=0)
        dtype = self.vision_tower.patch_embedder.input_proj.weight.dtype
        for _, rows, cols in grids:
            n = rows * cols
            out.append(self.embed_vision(self.vision_tower(patches[at:at + n], rows, cols)
                                         .astype(dtype)))
            at += n
        return mx.concatenate(out, axis=0)

    def token_embeddings(self, tokens: mx.array) -> mx.array:
        """The tokens' input embeddings [B, T] -> [B, T, D], scaled as the decoder scales
        them (`begin(..., input_embeddings=)` takes them as they are)."""
        return self.language_model.embed(tokens)

    def embed_prompt(self, ids: list, pixels: mx.array, grids: list) -> mx.array:
        """The prompt's input embeddings [1, L, D], the images' soft tokens (unscaled) at
        the image tokens."""
        tokens = mx.array(ids)
        embeds = self.token_embeddings(tokens[None])
        feats = self.image_features(pixels, grids)
        return gemma4_vision.merge(embeds, tokens, feats, self.vision.image_token_id)

    @property
    def donor(self):
        return self.language_model.donor

    def drop_vision(self) -> None:
        """Text-only from now on (a checkpoint whose config describes the tower but whose
        weights do not have it, as text-only conversions are)."""
        for name in ("vision_tower", "vision_embedder", "embed_vision"):
            if name in self:
                del self[name]
        self.vision = None
        self.whole_image_prompts = False
        self.language_model.set_media_tokens(())
        self.language_model.set_image_blocks(())

    def sanitize(self, weights: dict) -> dict:
        mine = ("vision_embedder.", "embed_vision.") if "vision_embedder" in self else \
            ("vision_tower.", "embed_vision.")
        if self.vision is not None and not any(
                k.removeprefix("model.").startswith(mine[0]) for k in weights):
            self.drop_vision()
        out = {}
        for k, v in weights.items():
            hf = k.startswith("model.")
            k = k.removeprefix("model.")
            if k.startswith(_TOWERS) and not (self.vision is not None and k.startswith(mine)):
                continue
            if hf and k.startswith("language_model."):
                k = k.replace("language_model.", "language_model.model.", 1)
            out[k] = v
        inner = {k.removeprefix("language_model."): v for k, v in out.items()
                 if k.startswith("language_model.")}
        inner = self.language_model.sanitize(inner)
        rest = {k: v for k, v in out.items() if k.startswith(mine)}
        if self.vision is not None and mine[0] == "vision_tower.":
            rest = gemma4_vision.sanitize(rest, self.vision_tower.args.use_clipped_linears)
        return {**rest, **{f"language_model.{k}": v for k, v in inner.items()}}

    def token_split(self, i):
        return self.language_model.token_split(i)

    def quant_predicate(self, path: str, module) -> object:
        return self.language_model.quant_predicate(path, module)

