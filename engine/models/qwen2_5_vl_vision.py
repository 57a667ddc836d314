"""Qwen2.5-VL's vision tower (`vision_tower.*` in mlx-vlm's layout, `visual.*` in HF's).

- **Patch embedding**: each row of the pixel values ([C, T, P, P] flattened, see
  `engine.vision.qwen2_5_vl`) goes through a 3-D convolution whose kernel is the whole
  temporal x spatial patch (no bias): one `hidden_size` vector per patch.
- **2-D rotary embedding**: every patch has a (row, column) position in its image's patch
  grid; half of each head's rotary angles follow the row, half the column (theta 10000 over
  head_dim / 2 dims), applied as `x cos + rotate_half(x) sin` in float32.
- **Windows**: the patches are reordered so that each window of
  `window_size / patch_size` patches a side (in merge units: `window_size / merge /
  patch`) is contiguous; blocks listed in `fullatt_block_indexes` attend over the whole
  image, the others within their window only (each window its own attention call).
- **Blocks**: pre-RMSNorm (eps 1e-6) attention with one fused qkv projection (biased) and
  a biased SwiGLU MLP.
- **Merger**: RMSNorm, then each `merge x merge` group of patches concatenated and passed
  through Linear -> GELU (erf) -> Linear to the text decoder's width; the window order is
  undone at the end.

Input: pixel values [N, C*T*P*P] for all images together and their grids [(t, h, w)];
output: [N / merge^2, out_hidden_size], the images' tokens in prompt order."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .base import ArgsBase


@dataclass
class VisionArgs(ArgsBase):
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    out_hidden_size: int = 3584
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: list = field(default_factory=lambda: [7, 15, 23, 31])


def rotate_half(x):
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rotate(x, freqs):
    """x [1, N, heads, hd], freqs [N, hd / 2] (float32) -> x rotated, in x's dtype."""
    cos = mx.tile(mx.cos(freqs)[:, None], (1, 1, 2))[None]
    sin = mx.tile(mx.sin(freqs)[:, None], (1, 1, 2))[None]
    return (x * cos + rotate_half(x) * sin).astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def __call__(self, x, bounds: list, freqs):
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.heads, -1).transpose(1, 0, 2, 3)
        q, k, v = qkv[0:1], qkv[1:2], qkv[2:3]                       # [1, N, heads, hd]
        q = _rotate(q[None], freqs)[0].transpose(0, 2, 1, 3)         # [1, heads, N, hd]
        k = _rotate(k[None], freqs)[0].transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        outs = [mx.fast.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                     scale=self.scale, mask=None)
                for a, b in zip(bounds[:-1], bounds[1:])]
        out = mx.concatenate(outs, axis=2).transpose(0, 2, 1, 3).reshape(n, -1)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.norm1 = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.norm2 = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.attn = Attention(a.hidden_size, a.num_heads)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def __call__(self, x, bounds, freqs):
        x = x + self.attn(self.norm1(x), bounds, freqs)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.shape = (a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        k = self.shape[1:]
        self.proj = nn.Conv3d(a.in_channels, a.hidden_size, kernel_size=k, stride=k, bias=False)

    def __call__(self, pixels):            # [N, C*T*P*P] -> [N, hidden]
        x = pixels.reshape(-1, *self.shape).moveaxis(1, 4)      # [N, T, P, P, C]
        return self.proj(x).reshape(x.shape[0], -1)


class Merger(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.width = a.hidden_size * a.spatial_merge_size ** 2
        self.ln_q = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.mlp = [nn.Linear(self.width, self.width), nn.GELU(),
                    nn.Linear(self.width, a.out_hidden_size)]

    def __call__(self, x):
        x = self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


def patch_positions(grids: list, merge: int) -> np.ndarray:
    """[(row, col)] of every patch, in the pixel values' order (merge windows together)."""
    out = []
    for t, h, w in grids:
        rows = np.broadcast_to(np.arange(h)[:, None], (h, w))
        cols = np.broadcast_to(np.arange(w)[None, :], (h, w))
        pos = [p.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
               for p in (rows, cols)]
        out.append(np.tile(np.stack(pos, axis=-1), (t, 1)))
    return np.concatenate(out, axis=0)


def window_order(grids: list, merge: int, window: int) -> tuple:
    """(order of the merge units so each window is contiguous, window boundaries in
    patches). `window`: a window's side in merge units."""
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        units = np.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    win = units[f, r:r + window, c:c + window].reshape(-1)
                    order.append(win + base)
                    bounds.append(bounds[-1] + win.size * merge * merge)
        base += t * gh * gw
    return np.concatenate(order), bounds


class VisionTower(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.blocks = [Block(a) for _ in range(a.depth)]
        self.merger = Merger(a)
        rot = a.hidden_size // a.num_heads // 2           # rotary dims per axis pair
        self._inv_freq = 1.0 / (10000.0 ** (mx.arange(0, rot, 2, dtype=mx.float32) / rot))

    def _freqs(self, grids: list, order: np.ndarray):
        m = self.args.spatial_merge_size
        pos = patch_positions(grids, m)
        side = max(max(h, w) for _, h, w in grids)
        table = mx.outer(mx.arange(side, dtype=mx.float32), self._inv_freq)
        freqs = table[mx.array(pos)].reshape(pos.shape[0], -1)           # [N, hd / 2]
        freqs = freqs.reshape(-1, m * m, freqs.shape[-1])[mx.array(order)]
        return freqs.reshape(pos.shape[0], -1)

    def __call__(self, pixels: mx.array, grids: list) -> mx.array:
        a, m = self.args, self.args.spatial_merge_size
        grids = [tuple(int(v) for v in g) for g in grids]
        x = self.patch_embed(pixels)
        n = x.shape[0]
        order, windows = window_order(grids, m, a.window_size // m // a.patch_size)
        freqs = self._freqs(grids, order)
        x = x.reshape(n // (m * m), m * m, -1)[mx.array(order)].reshape(n, -1)
        full = [0]                  # each frame of each image: one full-attention span
        for t, h, w in grids:
            for _ in range(t):
                full.append(full[-1] + h * w)
        for i, blk in enumerate(self.blocks):
            x = blk(x, full if i in a.fullatt_block_indexes else windows, freqs)
        x = self.merger(x)
        return x[mx.array(np.argsort(order))]

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """HF's `visual.*` names and [out, C, T, P, P] convolution -> mlx-vlm's layout."""
        out = {}
        for k, v in weights.items():
            if k.startswith("visual."):
                k = "vision_tower." + k[len("visual."):]
            if k.endswith("patch_embed.proj.weight") and v.ndim == 5 and v.shape[-1] != 3 \
                    and v.shape[1] == 3:
                v = v.transpose(0, 2, 3, 4, 1)
            out[k] = v
        return out
