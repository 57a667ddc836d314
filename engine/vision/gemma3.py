"""Gemma 3's image preprocessing and prompt expansion, equal to mlx-vlm 0.7.x's
(transformers' Gemma3ImageProcessor, PIL backend, as mlx-vlm loads it):

resize to image_size x image_size (Pillow, bilinear) -> x * rescale_factor in float64,
then float32 -> (x - mean) / std in float32 -> [N, 3, H, W] float32 pixel values.
No pan-and-scan (the released configs leave it off).

The prompt: every `<start_of_image>` the chat template emits becomes
"\\n\\n<start_of_image>" + `<image_soft_token>` x tokens_per_image + "<end_of_image>\\n\\n"
before the text is tokenized."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Gemma3Preprocess:
    size: tuple                                   # (height, width)
    mean: tuple = IMAGENET_STANDARD
    std: tuple = IMAGENET_STANDARD
    rescale_factor: float = 1 / 255
    resample: int = 2                             # PIL bilinear

    @classmethod
    def from_config(cls, image_size: int, pre: dict) -> "Gemma3Preprocess":
        """From the checkpoint's preprocessor_config.json (its fields override the defaults)."""
        size = pre.get("size") or {}
        hw = (int(size.get("height", image_size)), int(size.get("width", image_size)))
        return cls(size=hw, mean=tuple(pre.get("image_mean", IMAGENET_STANDARD)),
                   std=tuple(pre.get("image_std", IMAGENET_STANDARD)),
                   rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
                   resample=int(pre.get("resample", 2)))

    def pixels(self, image) -> np.ndarray:
        """An RGB PIL image -> [3, H, W] float32."""
        h, w = self.size
        x = np.array(image.resize((w, h), resample=self.resample))      # [H, W, 3] uint8
        x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = (x - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return np.ascontiguousarray(np.moveaxis(x, -1, 0))


def expand(text: str, boi: str, image: str, eoi: str, tokens_per_image: int) -> str:
    return text.replace(boi, f"\n\n{boi}{image * tokens_per_image}{eoi}\n\n")
