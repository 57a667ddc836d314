"""Qwen2.5-VL's image preprocessing and prompt expansion, equal to mlx-vlm 0.7.x's (its numpy
port of the Qwen2-VL image processor, which mlx-vlm loads for `qwen2_5_vl` checkpoints):

1. **Smart resize**: the side lengths become multiples of `patch_size * merge_size` (28 on
   the released models), each rounded to the nearest multiple; if the area is then above
   `max_pixels` both sides shrink by sqrt(area / max_pixels) (rounded down to multiples),
   below `min_pixels` both grow by sqrt(min_pixels / area) (rounded up). An aspect ratio
   over 200 is refused. Pillow's bicubic filter on the uint8 RGB image (no resize when
   the size already fits).
2. **Normalise**: float32, `x * rescale_factor`, then `(x - mean) / std` per channel, all
   in float32.
3. **Patches**: the [C, H, W] image repeated `temporal_patch_size` times along time (a still
   image is one temporal patch), cut into `patch_size` squares ordered by merge window
   (the `merge_size x merge_size` patches that the tower's merger joins into one token are
   consecutive), each flattened as [C, T, P, P]: pixel values [grid_h * grid_w, C*T*P*P]
   float32 and the grid (t, h, w) = (1, H / P, W / P).

The prompt: the chat template renders an image part as
`<|vision_start|><|image_pad|><|vision_end|>`; each `<|image_pad|>` becomes
t * h * w / merge_size^2 of them (the image's tokens after the merger), in image order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HALF = (0.5, 0.5, 0.5)        # mlx-vlm's defaults when the config gives no mean / std


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple:
    """(height, width) after Qwen2-VL's resize rule (see the module's docstring)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio {max(height, width) / min(height, width):.1f} "
                         "is over 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


@dataclass(frozen=True)
class Qwen25VLPreprocess:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple = HALF
    std: tuple = HALF
    rescale_factor: float = 1 / 255

    @classmethod
    def from_config(cls, pre: dict, vision: dict | None = None) -> "Qwen25VLPreprocess":
        """From preprocessor_config.json (`pre`; `size.shortest_edge` / `longest_edge` are
        min / max pixels, top-level `min_pixels` / `max_pixels` win), the tower's config
        (`vision`) giving the patch sizes when `pre` does not."""
        vision = vision or {}
        size = pre.get("size") or {}
        lo = pre.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
        hi = pre.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
        return cls(
            patch_size=int(pre.get("patch_size", vision.get("patch_size", 14))),
            temporal_patch_size=int(pre.get("temporal_patch_size",
                                            vision.get("temporal_patch_size", 2))),
            merge_size=int(pre.get("merge_size", vision.get("spatial_merge_size", 2))),
            min_pixels=int(lo), max_pixels=int(hi),
            mean=tuple(pre.get("image_mean") or HALF), std=tuple(pre.get("image_std") or HALF),
            rescale_factor=float(pre.get("rescale_factor", 1 / 255)))

    def size_for(self, width: int, height: int) -> tuple:
        """(height, width) an image of this size is resized to."""
        return smart_resize(height, width, self.patch_size * self.merge_size,
                            self.min_pixels, self.max_pixels)

    def tokens_for(self, grid: tuple) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size ** 2)

    def patches(self, image) -> tuple:
        """An RGB PIL image -> (pixel values [h * w, C*T*P*P] float32, grid (1, h, w))."""
        from PIL import Image

        rh, rw = self.size_for(*image.size)
        if (rh, rw) != (image.size[1], image.size[0]):
            image = image.resize((rw, rh), resample=Image.BICUBIC)
        x = np.array(image).astype(np.float32) * self.rescale_factor      # [H, W, C]
        x = (x - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        x = np.moveaxis(x, -1, 0)                                         # [C, H, W]
        c = x.shape[0]
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = rh // p, rw // p
        x = np.broadcast_to(x[None], (tp,) + x.shape)                    # [T, C, H, W]
        x = x.reshape(tp, c, gh // m, m, p, gw // m, m, p)
        # -> [row block, col block, row in block, col in block, C, T, P, P]
        x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)
        return np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p)), (1, gh, gw)


def expand(text: str, image: str, counts: list) -> str:
    """Each `image` marker of `text`, in order, repeated counts[i] times."""
    parts = text.split(image)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"{len(parts) - 1} image markers for {len(counts)} images")
    out = [parts[0]]
    for n, rest in zip(counts, parts[1:]):
        out += [image * n, rest]
    return "".join(out)
