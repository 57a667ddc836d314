"""Images in prompts: decoding (`images`), each vision family's preprocessing and prompt
expansion (`gemma3`, `qwen2_5_vl`), and `vision_prompt`, which turns chat messages with image parts plus
the images' bytes into the prompt's token ids and a `VisionInput` for `Engine.submit`.

An image part in a message's content is `{"type": "image"}` (the chat templates' own
shape); the images come separately, in the order of those parts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from .gemma3 import Gemma3Preprocess, expand
from .gemma4 import Gemma4Preprocess, Gemma4UnifiedPreprocess, expand as expand_soft
from .qwen2_5_vl import Qwen25VLPreprocess, expand as expand_runs
from .images import DEFAULT_MAX_PIXELS, ImageError, decode_image, formats

# a request's images together (16 images of 5 MP; a header declaring 36 MP in 100 bytes costs
# the decoder its pixels: the budget bounds a request's decoding work)
MAX_REQUEST_PIXELS = 80_000_000

__all__ = ["DEFAULT_MAX_PIXELS", "MAX_REQUEST_PIXELS", "ImageError", "VisionInput", "decode_image", "formats",
           "image_formats", "preprocessor_for", "vision_prompt", "has_vision"]

image_formats = formats


@dataclass(frozen=True)
class VisionInput:
    """A request's images, ready for the model: pixel values and the digest of the images'
    bytes (in order), which keys the prompt cache. Gemma 3: pixels [N, C, H, W] float32.
    Qwen2.5-VL: pixels [patches, C*T*P*P] float32 of all images together, `grids` each
    image's (t, h, w) patch grid and `tokens` the prompt's image tokens in all."""
    pixels: mx.array
    digest: str
    count: int
    grids: Optional[tuple] = None
    tokens: Optional[int] = None


def has_vision(model) -> bool:
    return getattr(model, "vision", None) is not None


def preprocessor_for(model, model_dir=None):
    """The model's image preprocessing (its `preprocessor_config.json` when `model_dir` has
    one, else the family's defaults at the tower's image size)."""
    info = model.vision
    pre = {}
    names = ("preprocessor_config.json",)
    if info.kind == "gemma4":              # (mlx-vlm reads processor_config.json first)
        names = ("processor_config.json", "preprocessor_config.json")
    for name in names:
        if model_dir is not None and (Path(model_dir) / name).exists():
            try:
                pre = json.loads((Path(model_dir) / name).read_text())
            except ValueError:
                pre = {}
            break
    if info.kind == "gemma4" and "vision_embedder" in model:        # gemma4_unified
        return Gemma4UnifiedPreprocess.from_config(vars(model.vision_embedder.args), pre)
    if info.kind == "gemma4":
        return Gemma4Preprocess.from_config(vars(model.vision_tower.args), pre)
    if info.kind == "gemma3":
        return Gemma3Preprocess.from_config(info.image_size, pre)
    if info.kind == "qwen2_5_vl":
        a = model.vision_tower.args
        return Qwen25VLPreprocess.from_config(pre, {
            "patch_size": a.patch_size, "temporal_patch_size": a.temporal_patch_size,
            "spatial_merge_size": a.spatial_merge_size})
    raise ValueError(f"no image preprocessing for {info.kind!r}")   # pragma: no cover


def _token(tokenizer, tid: int) -> str:
    tok = tokenizer.convert_ids_to_tokens(tid)
    return tok[0] if isinstance(tok, list) else tok


def vision_prompt(model, tokenizer, messages: list, images: list, *, tools=None,
                  template_kwargs: Optional[dict] = None, preprocess=None,
                  max_pixels: int = DEFAULT_MAX_PIXELS,
                  max_request_pixels: int = MAX_REQUEST_PIXELS) -> tuple:
    """(prompt token ids, VisionInput) for chat `messages` whose image parts stand for
    `images` (encoded bytes, or RGB PIL images). PromptError/ImageError (client mistakes)
    when the model has no vision tower, an image does not decode, the images together have
    more than `max_request_pixels` pixels (checked from each header before it decodes), or
    the parts and images do not pair up."""
    from engine.step.request import PromptError

    if not has_vision(model):
        raise PromptError("this model has no vision tower: image inputs are not supported")
    if getattr(model, "vision_refused", None):
        raise PromptError(model.vision_refused)
    if not images:
        raise PromptError("vision_prompt needs at least one image")
    info = model.vision
    preprocess = preprocess or preprocessor_for(model)
    arrays, h = [], hashlib.sha256()
    used = 0
    for i, img in enumerate(images):   # one at a time: a decoded image is dropped once
        left = max_request_pixels - used
        if isinstance(img, (bytes, bytearray)):     # preprocessed (40 MP is 120 MB of RGB)
            h.update(hashlib.sha256(bytes(img)).digest())
            try:
                img = decode_image(img, min(max_pixels, left), where=f"image {i + 1}")
            except ImageError as e:
                if left >= max_pixels or "pixels, over the limit" not in str(e):
                    raise
                raise ImageError(f"image {i + 1}: the request's images together have more than "
                                 f"{max_request_pixels:,} pixels") from None
        else:                     # an already decoded image: its pixels are the key
            h.update(hashlib.sha256(img.tobytes() + repr(img.size).encode()).digest())
        used += img.size[0] * img.size[1]
        if used > max_request_pixels:
            raise ImageError(f"image {i + 1}: the request's images together have more than "
                             f"{max_request_pixels:,} pixels")
        try:
            arrays.append(preprocess.patches(img) if info.kind in ("qwen2_5_vl", "gemma4")
                          else preprocess.pixels(img))
        except ValueError as e:          # (an aspect ratio Qwen2.5-VL's resize refuses, ...)
            raise ImageError(f"image {i + 1}: {e}") from None
    img = None
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=True,
                                             **(template_kwargs or {}))
    except Exception as e:
        raise PromptError(f"chat template failed: {e}") from None
    if info.kind == "gemma4":
        return _gemma4_prompt(tokenizer, info, text, arrays, preprocess, h.hexdigest())
    if info.kind == "qwen2_5_vl":
        return _qwen_prompt(tokenizer, info, text, arrays, preprocess, h.hexdigest())
    boi = _token(tokenizer, info.boi_token_id)
    marks = text.count(boi)
    if marks != len(arrays):
        raise PromptError(f"the prompt has {marks} image marker(s) ({boi}) for "
                          f"{len(arrays)} image(s); the text may not contain {boi} itself")
    text = expand(text, boi, _token(tokenizer, info.image_token_id),
                  _token(tokenizer, info.eoi_token_id), info.tokens_per_image)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pixels = mx.array(np.stack(arrays))
    return ids, VisionInput(pixels, h.hexdigest(), len(arrays))


def _qwen_prompt(tokenizer, info, text: str, arrays: list, preprocess, digest: str) -> tuple:
    """Qwen2.5-VL: each `<|image_pad|>` the template rendered becomes the image's tokens."""
    from engine.step.request import PromptError

    pad = _token(tokenizer, info.image_token_id)
    marks = text.count(pad)
    if marks != len(arrays):
        raise PromptError(f"the prompt has {marks} image marker(s) ({pad}) for "
                          f"{len(arrays)} image(s); the text may not contain {pad} itself")
    grids = tuple(g for _, g in arrays)
    counts = [preprocess.tokens_for(g) for g in grids]
    ids = tokenizer.encode(expand_runs(text, pad, counts), add_special_tokens=False)
    pixels = mx.array(np.concatenate([a for a, _ in arrays]))
    return ids, VisionInput(pixels, digest, len(arrays), grids, sum(counts))


def _gemma4_prompt(tokenizer, info, text: str, arrays: list, preprocess, digest: str) -> tuple:
    """Gemma 4: each image token the template rendered becomes boi + the image's soft tokens
    + eoi (boi / eoi: none where the config names none)."""
    from engine.step.request import PromptError

    image = _token(tokenizer, info.image_token_id)
    marks = text.count(image)
    if marks != len(arrays):
        raise PromptError(f"the prompt has {marks} image marker(s) ({image}) for "
                          f"{len(arrays)} image(s); the text may not contain {image} itself")
    boi, eoi = (_token(tokenizer, t) if t >= 0 else "" for t in (info.boi_token_id,
                                                                 info.eoi_token_id))
    grids = tuple(g for _, g in arrays)
    counts = [preprocess.tokens_for(g) for g in grids]
    ids = tokenizer.encode(expand_soft(text, image, boi, eoi, counts), add_special_tokens=False)
    pixels = mx.array(np.concatenate([a for a, _ in arrays]))
    return ids, VisionInput(pixels, digest, len(arrays), grids, sum(counts))
