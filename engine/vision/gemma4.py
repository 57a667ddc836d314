"""Gemma 4's image preprocessing and prompt expansion, equal to mlx-vlm 0.7.x's
(its numpy Gemma4ImageProcessor):

- the image keeps its aspect ratio: both sides are scaled by sqrt(budget / area), where the
  budget is `max_soft_tokens * pooling_kernel_size^2` patches of `patch_size^2` pixels, then
  rounded down to multiples of `pooling_kernel_size * patch_size` (a side that rounds to 0
  becomes one multiple and the other its aspect ratio's, capped); an image already at that
  size is not resampled, any other is resized by Pillow's bicubic filter on the uint8 image;
- `x.astype(float32) * rescale_factor` (no normalisation unless `do_normalize`; the tower
  maps [0, 1] to [-1, 1] itself);
- channel-first [3, H, W] float32.

The tower takes non-overlapping patch_size x patch_size patches, each flattened as
[row, column, channel] (`patches`), with the patch's (column, row) as its position. One image
gives (H / p) * (W / p) / k^2 soft tokens; the prompt's image marker becomes
`boi + image_token * n + eoi` (boi and eoi are empty where the tokenizer has none)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BICUBIC = 3


def target_size(height: int, width: int, patch: int, max_patches: int, pool: int) -> tuple:
    """(height, width) an image of that size is resized to."""
    factor = math.sqrt(max_patches * patch * patch / (height * width))
    side = pool * patch
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ValueError("the image is too small to resize (it would be 0 x 0)")
    longest = (max_patches // (pool * pool)) * side
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        tw, th = side, min(int(math.floor(height / width)) * side, longest)
    return th, tw


@dataclass(frozen=True)
class Gemma4Preprocess:
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, tower: dict, pre: dict) -> "Gemma4Preprocess":
        """The tower's patch and pooling sizes, overridden by the checkpoint's
        processor_config.json / preprocessor_config.json (flat or under image_processor)."""
        pre = dict(pre.get("image_processor") or pre)
        return cls(patch_size=int(pre.get("patch_size", tower.get("patch_size", 16))),
                   max_soft_tokens=int(pre.get("max_soft_tokens",
                                               tower.get("default_output_length", 280))),
                   pooling_kernel_size=int(pre.get("pooling_kernel_size",
                                                   tower.get("pooling_kernel_size", 3))),
                   rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
                   do_normalize=bool(pre.get("do_normalize", False)),
                   mean=tuple(pre.get("image_mean") or (0.5, 0.5, 0.5)),
                   std=tuple(pre.get("image_std") or (0.5, 0.5, 0.5)))

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    def pixels(self, image) -> np.ndarray:
        """An RGB PIL image -> [3, H, W] float32."""
        x = np.array(image)                                    # [H, W, 3] uint8
        th, tw = target_size(x.shape[0], x.shape[1], self.patch_size, self.max_patches,
                             self.pooling_kernel_size)
        if (th, tw) != x.shape[:2]:
            x = np.array(image.resize((tw, th), resample=BICUBIC))
        x = x.astype(np.float32) * self.rescale_factor
        if self.do_normalize:
            x = (x - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return np.ascontiguousarray(np.transpose(x, (2, 0, 1)))

    def patches(self, image) -> tuple:
        """An RGB PIL image -> (patches [(H/p)(W/p), p*p*3] float32, grid (1, H/p, W/p))."""
        return to_patches(self.pixels(image), self.patch_size)

    def tokens_for(self, grid) -> int:
        return grid[1] * grid[2] // self.pooling_kernel_size ** 2


def to_patches(pixels: np.ndarray, p: int) -> tuple:
    """[3, H, W] -> ([rows * cols, p * p * 3] in row-major patch order, (1, rows, cols))."""
    c, h, w = pixels.shape
    rows, cols = h // p, w // p
    x = pixels[:, :rows * p, :cols * p].reshape(c, rows, p, cols, p)
    x = x.transpose(1, 3, 2, 4, 0).reshape(rows * cols, p * p * c)
    return np.ascontiguousarray(x), (1, rows, cols)


def expand(text: str, marker: str, boi: str, eoi: str, counts: list) -> str:
    """Each `marker` in `text` (in order) becomes boi + marker * count + eoi."""
    parts = text.split(marker)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"{len(parts) - 1} image markers for {len(counts)} images")
    out = [parts[0]]
    for n, rest in zip(counts, parts[1:]):
        out.append(f"{boi}{marker * n}{eoi}{rest}")
    return "".join(out)


@dataclass(frozen=True)
class Gemma4UnifiedPreprocess(Gemma4Preprocess):
    """`gemma4_unified`: the same resize and rescale; the patches are model patches of
    patch_size * pooling_kernel_size pixels (what mlx-vlm's processor cuts, whatever its
    `model_patch_size` says), one soft token each."""

    @classmethod
    def from_config(cls, tower: dict, pre: dict) -> "Gemma4UnifiedPreprocess":
        tower = dict(tower)
        tower.setdefault("default_output_length", tower.get("num_soft_tokens", 280))
        ip = dict(pre.get("image_processor") or pre)
        if "max_soft_tokens" not in ip and "num_soft_tokens" in ip:
            ip["max_soft_tokens"] = ip["num_soft_tokens"]
        return cls(**vars(Gemma4Preprocess.from_config(tower, ip)))

    def patches(self, image) -> tuple:
        return to_patches(self.pixels(image), self.patch_size * self.pooling_kernel_size)

    def tokens_for(self, grid) -> int:
        return grid[1] * grid[2]
