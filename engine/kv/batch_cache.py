"""Batched KV caches: B rows in one [B, heads, T, head_dim] buffer, left-padded.

Row b's real tokens occupy the columns from ``left_padding[b]`` up to the write position;
``offset[b]`` is its true length (its next RoPE position); masks hide the padding. A prefill
chunk of rows of different lengths is written right-padded (``prepare``), and ``finalize()``
rolls each row's trailing pads to its front. Rows leave with ``filter``, join with ``extend``.
Layout and transitions follow mlx-lm 0.32.2's BatchKVCache / BatchRotatingKVCache on purpose:
attention sees the same arrays under the same masks, hence logits bit-identical to its
BatchGenerator."""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx

from engine.kv.cache import KVCache, RotatingKVCache
from engine.kv.batch_ops import each as _each, every_row as _every_row, ints as _ints
from engine.kv.batch_ops import pad_time as _pad_time, part as _part, roll_rows
from engine.kv.masks import causal_mask


class _Rows:
    """Both batched caches: per-row `offset`, `left_padding`; keys/values [B, heads, T, D]."""

    step = 256
    bits = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    @property
    def batch_size(self) -> int:
        return self.offset.shape[0]

    def empty(self) -> bool:
        return self.keys is None

    def _apply(self, fn):       # fn on keys and values (the quantized form: on each part)
        self.keys, self.values = _each(fn, self.keys), _each(fn, self.values)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class BatchKVCache(_Rows):
    """Growing batched cache for full-attention layers."""

    _lp_seen, _lp_max = None, 0       # (left_padding whose host max is _lp_max: _unmasked)

    def __init__(self, left_padding: Sequence[int]):
        self.keys = None
        self.values = None
        self._solo = len(left_padding) == 1     # one row since the start (see _unmasked)
        self.left_padding = _ints(left_padding)
        self.offset = -self.left_padding
        self._idx = 0                       # next column to write (shared by all rows)
        self._right_padding = None

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_caches(cls, caches: Sequence[KVCache]) -> "BatchKVCache":
        """Stack single-row caches (possibly empty), right-aligned."""
        sizes = [c.offset if c.keys is not None else 0 for c in caches]
        T = max(sizes)
        if T == 0:
            return cls([0] * len(caches))
        pads = [T - s for s in sizes]
        ref = next(c for c in caches if c.keys is not None and c.offset)
        _, H, _, dk = ref.keys.shape
        dv = ref.values.shape[3]
        keys = mx.zeros((len(caches), H, T, dk), ref.keys.dtype)
        values = mx.zeros((len(caches), H, T, dv), ref.values.dtype)
        for b, (p, s, c) in enumerate(zip(pads, sizes, caches)):
            if s:
                keys[b:b + 1, :, p:] = c.keys[..., :s, :]
                values[b:b + 1, :, p:] = c.values[..., :s, :]
        out = cls(pads)
        out.keys, out.values = keys, values
        out.offset = out.offset + T
        out._idx = T
        return out

    # -- the model-facing protocol ----------------------------------------------
    def update_and_fetch(self, keys, values):
        start, n = self._idx, keys.shape[2]
        if self.keys is None or start + n > self.keys.shape[2]:
            B, H, _, dk = keys.shape
            grow = (n + self.step - 1) // self.step * self.step
            nk = mx.zeros((B, H, grow, dk), keys.dtype)
            nv = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = nk, nv
            else:
                if start % self.step:
                    self.keys, self.values = self.keys[..., :start, :], self.values[..., :start, :]
                self.keys = mx.concatenate([self.keys, nk], axis=2)
                self.values = mx.concatenate([self.values, nv], axis=2)
        self._idx = start + n
        self.offset = self.offset + n
        self.keys[..., start:self._idx, :] = keys
        self.values[..., start:self._idx, :] = values
        return self.keys[..., :self._idx, :], self.values[..., :self._idx, :]

    def make_mask(self, n: int, window_size: Optional[int] = None, return_array: bool = False):
        if not return_array and self._unmasked(n, window_size):
            return None if n == 1 else "causal"
        return causal_mask(n, self._idx, window=window_size, left_padding=self.left_padding)

    def _unmasked(self, n: int, window_size: Optional[int]) -> bool:
        """A batch that has held one row from its start, unpadded and uncut by a window, runs
        as mlx_lm.generate does: no mask to decode, "causal" to prefill (CUDA's fused vector
        attention, cuDNN's causal attention without a bias tensor; docs/batching.md)."""
        if not self._solo or (window_size is not None and self._idx + n > window_size):
            return False
        if self._lp_seen is not self.left_padding:      # host copy of max(left_padding), once
            self._lp_seen, self._lp_max = self.left_padding, max(self.left_padding.tolist(), default=0)
        return self._lp_max <= 0

    # -- right-padded prefill ---------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch cache")
            lp = _ints(left_padding)
            self.left_padding = self.left_padding + lp
            self.offset = self.offset - lp
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = _ints(right_padding)

    def finalize(self):
        rp = self._right_padding
        if rp is None:
            return
        self._apply(lambda x: roll_rows(x, rp))
        self.offset = self.offset - rp
        self.left_padding = self.left_padding + rp
        self._right_padding = None

    def rewind(self, drop: Sequence[int]):
        """Take the last drop[b] columns back from each row b (the rejected drafts of a verify
        forward, `engine.step.batch_lookup`): the columns every row drops leave the shared end
        (no copy); each row's others are rolled to its front, where they are padding."""
        m = min(drop)
        self._idx -= m
        self.offset = self.offset - m
        self.prepare(right_padding=[d - m for d in drop])
        self.finalize()

    # -- rows leave / join --------------------------------------------------------
    def filter(self, keep: List[int]):
        self._solo = self._solo and len(keep) == self.batch_size
        if self.keys is not None and not _every_row(keep, self.batch_size):
            self._apply(lambda x: x[keep])
        self.offset = self.offset[keep]
        self.left_padding = self.left_padding[keep]
        drop = min(self.left_padding.tolist())
        if drop > 0:                       # every row has padding there: cut it
            if self.keys is not None:
                self._apply(lambda x: x[..., drop:, :])
            self._idx -= drop
            self.left_padding = self.left_padding - drop

    def extend(self, other: "BatchKVCache"):
        self._solo = (self._solo and not other.batch_size) or (other._solo and not self.batch_size)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        cap = max(_part(c.keys).shape[2] for c in (self, other) if c.keys is not None)
        kv, lps = [], []
        for c in (self, other):
            k, v, left = c.keys, c.values, idx - c._idx
            if k is None:           # (no columns yet: empty ones shaped as ref's)
                none = lambda x, n=c.batch_size: mx.zeros((n, x.shape[1], 0, x.shape[3]), x.dtype)  # noqa: E731
                k, v = _each(none, ref.keys), _each(none, ref.values)
            pad = lambda x, left=left: _pad_time(x, left, cap - x.shape[2] - left)  # noqa: E731
            kv.append((_each(pad, k), _each(pad, v)))
            lps.append(c.left_padding + left)
        (k0, v0), (k1, v1) = kv
        cat = lambda a, b: mx.concatenate([a, b])             # noqa: E731
        self.keys, self.values = _each(cat, k0, k1), _each(cat, v0, v1)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding, self._idx = mx.concatenate(lps), idx

    def extract(self, b: int) -> KVCache:
        """Row b as a single-row KVCache (its real tokens only)."""
        pad = int(self.left_padding[b].item())
        c = KVCache()
        c.keys = mx.contiguous(self.keys[b:b + 1, :, pad:self._idx])
        c.values = mx.contiguous(self.values[b:b + 1, :, pad:self._idx])
        c.offset = c.keys.shape[2]
        return c

    def size(self) -> int:
        return self._idx


class BatchRotatingKVCache(_Rows):
    """Batched ring buffer for sliding-window layers (no sink tokens). `_idx`: the shared write
    position; `_written`: columns ever written (padding included); `rotated`: writes wrapped.
    Per row, `left_padding` counts the columns (from the buffer's logical start) that are not
    its tokens; it goes negative once the padding is pushed out of the window. `temporal`
    (deterministic mode, `engine.kv.cache.temporal_caches`): the buffer never wraps, so each
    row's window is read oldest first, as the row alone reads it (`_append`, `_write_after`)."""

    temporal = False

    def __init__(self, max_size: int, left_padding: Sequence[int]):
        self.keys = None
        self.values = None
        self.left_padding = _ints(left_padding)
        self.offset = -self.left_padding
        self.max_size = max_size
        self._idx = 0
        self._written = 0
        self.rotated = False
        self._lengths = None          # set during a right-padded prefill

    @classmethod
    def from_caches(cls, caches: Sequence[RotatingKVCache]) -> "BatchRotatingKVCache":
        W = caches[0].max_size
        if any(c.max_size != W for c in caches):
            raise ValueError("rotating caches of different window sizes cannot be batched")
        out = cls._stacked(W, caches)
        out.temporal = any(c.temporal for c in caches)
        return out

    @classmethod
    def _stacked(cls, W: int, caches: Sequence[RotatingKVCache]) -> "BatchRotatingKVCache":
        sizes = [c.size() if c.keys is not None else 0 for c in caches]
        T = max(sizes)
        if T == 0:
            return cls(W, [0] * len(caches))
        pads = [T - s for s in sizes]
        ref = next(c for c in caches if c.keys is not None and c.offset)
        _, H, _, dk = ref.keys.shape
        dv = ref.values.shape[3]
        keys = mx.zeros((len(caches), H, T, dk), ref.keys.dtype)
        values = mx.zeros((len(caches), H, T, dv), ref.values.dtype)
        for b, (p, s, c) in enumerate(zip(pads, sizes, caches)):
            if s:
                keys[b:b + 1, :, p:] = c.temporal_order(c.keys)[..., -s:, :]
                values[b:b + 1, :, p:] = c.temporal_order(c.values)[..., -s:, :]
        out = cls(W, pads)
        out.keys, out.values = keys, values
        out.offset = _ints(c.offset for c in caches)
        out._idx = out._written = T
        return out

    # -- helpers ------------------------------------------------------------------
    def _unrotate(self):
        if self.rotated:
            self.keys = mx.roll(self.keys, -self._idx, axis=2)
            self.values = mx.roll(self.values, -self._idx, axis=2)
            self._idx = self.keys.shape[2]
            self.rotated = False

    def _roll_right_pads(self):
        """Move the pads a right-padded chunk wrote to the front of their rows."""
        shift = mx.maximum(0, self.offset - self._lengths)
        self.keys = roll_rows(self.keys, shift)
        self.values = roll_rows(self.values, shift)
        self.left_padding = self.left_padding + shift
        self.offset = self.offset - shift

    def _append(self, keys, values):
        n = keys.shape[2]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self._unrotate()
            if self.keys.shape[2] > self._idx:
                self.keys = self.keys[..., :self._idx, :]
                self.values = self.values[..., :self._idx, :]
            if self._lengths is not None:
                self._roll_right_pads()
            # keep max_size - 1 old columns so every new query sees a full window
            cut = self._idx - self.max_size + 1
            if cut > 0:
                self.left_padding = self.left_padding - cut
                self.keys = self.keys[..., cut:, :]
                self.values = self.values[..., cut:, :]
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset = self.offset + n
        self._written += n
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _write_after(self, keys, values):
        """A temporal cache's one-token write: into the room after the last column (cut back
        to the window's last max_size - 1 columns, one copy, when the room is used up);
        attention gets the last max_size columns, oldest first: `_append`'s arrays, without
        its copy of the window every step."""
        if self._lengths is not None:
            raise RuntimeError("finalize() the right-padded prefill before decoding")
        B, H, _, dk = keys.shape
        if self.keys is None or self._idx >= self.keys.shape[2]:
            keep = min(self._idx, self.max_size - 1)
            cut = self._idx - keep
            nk = mx.zeros((B, H, keep + self.step, dk), keys.dtype)
            nv = mx.zeros((B, H, keep + self.step, values.shape[3]), values.dtype)
            if keep:
                nk[..., :keep, :] = self.keys[..., cut:self._idx, :]
                nv[..., :keep, :] = self.values[..., cut:self._idx, :]
            self.keys, self.values = nk, nv
            self.left_padding = self.left_padding - cut
            self._idx = keep
        self.keys[..., self._idx:self._idx + 1, :] = keys
        self.values[..., self._idx:self._idx + 1, :] = values
        self._idx += 1
        self._written += 1
        self.offset = self.offset + 1
        lo = max(0, self._idx - self.max_size)
        return self.keys[..., lo:self._idx, :], self.values[..., lo:self._idx, :]

    def _write_one(self, keys, values):
        if self._lengths is not None:
            raise RuntimeError("finalize() the right-padded prefill before decoding")
        B, H, n, dk = keys.shape
        cap = 0 if self.keys is None else self.keys.shape[2]
        if self.keys is None or (self._written >= cap and cap < self.max_size):
            grow = min(self.step, self.max_size - self._written)
            nk = mx.zeros((B, H, grow, dk), keys.dtype)
            nv = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = nk, nv
            else:
                self.keys = mx.concatenate([self.keys, nk], axis=2)
                self.values = mx.concatenate([self.values, nv], axis=2)
            self._idx = self._written
        over = self.keys.shape[2] - self.max_size
        if over > 0:
            self.keys = self.keys[..., over:, :]
            self.values = self.values[..., over:, :]
            self._idx = self.max_size
            self.left_padding = self.left_padding - over
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding = self.left_padding - n
        self.keys[..., self._idx:self._idx + n, :] = keys
        self.values[..., self._idx:self._idx + n, :] = values
        self._written += n
        self.offset = self.offset + n
        self._idx += n
        if self._written < self.keys.shape[2]:
            return self.keys[..., :self._written, :], self.values[..., :self._written, :]
        return self.keys, self.values

    # -- the model-facing protocol ----------------------------------------------
    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return (self._write_after if self.temporal else self._write_one)(keys, values)
        return self._append(keys, values)

    def make_mask(self, n: int, window_size: Optional[int] = None, return_array: bool = False):
        W = window_size or self.max_size
        start = min(self.max_size - 1, self._written)
        mask = causal_mask(n, start, window=W)
        lp = self.left_padding
        appends = n > 1 or self.temporal       # (the write cuts the buffer to max_size - 1)
        cut = self._idx - self.max_size + (1 if appends else 0)
        if cut > 0:
            lp = lp - cut
        wrapped = not appends and (self.rotated or self._idx >= self.max_size)
        if wrapped:
            lp = lp - 1
        cols = mx.arange(start + n)[None]
        mask = mask & (cols >= mx.expand_dims(lp, (1, 2, 3)))
        if wrapped:
            at = 0 if self._idx >= self.max_size else self._idx
            mask = mx.roll(mask, shift=at + 1, axis=-1)
        return mask

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch cache")
            lp = _ints(left_padding)
            self.left_padding = self.left_padding + lp
            self.offset = self.offset - lp
        if right_padding is not None and max(right_padding) > 0:
            self._lengths = _ints(lengths) + self.offset

    def finalize(self):
        if self._lengths is not None:
            self._roll_right_pads()
            self._lengths = None

    # -- rows leave / join --------------------------------------------------------
    def filter(self, keep: List[int]):
        if self.keys is not None and not _every_row(keep, self.keys.shape[0]):
            self.keys, self.values = self.keys[keep], self.values[keep]
        self.offset = self.offset[keep]
        self.left_padding = self.left_padding[keep]

    def extend(self, other: "BatchRotatingKVCache"):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        if self.rotated != other.rotated or self._idx != other._idx:
            self._unrotate()
            other._unrotate()
        idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        _, H, _, dk = ref.keys.shape
        dv = ref.values.shape[3]
        cap = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)
        parts = []
        for c in (self, other):
            k, v = c.keys, c.values
            if k is None:
                nb = c.offset.shape[0]
                k = mx.zeros((nb, H, 0, dk), ref.keys.dtype)
                v = mx.zeros((nb, H, 0, dv), ref.keys.dtype)
            left = idx - c._idx
            right = cap - k.shape[2] - left
            parts.append((_pad_time(k, left, right), _pad_time(v, left, right),
                          c.offset, c.left_padding + left))
        self.keys, self.values, self.offset, self.left_padding = (
            mx.concatenate(list(p)) for p in zip(*parts))
        self._idx = idx
        self._written = max(self._written, other._written)
        self.temporal = self.temporal or other.temporal

    def extract(self, b: int) -> RotatingKVCache:
        """Row b as a single-row RotatingKVCache in temporal order."""
        pad = max(0, int(self.left_padding[b].item()))
        c = RotatingKVCache(self.max_size)
        c.temporal = self.temporal
        k, v, end = self.keys[b:b + 1], self.values[b:b + 1], self._idx
        if self.rotated:
            k, v, end = mx.roll(k, -self._idx, axis=2), mx.roll(v, -self._idx, axis=2), self.max_size
        if self.temporal:      # (the window: what `_append` would have kept)
            pad = max(pad, end - self.max_size)
        c.keys = mx.contiguous(k[:, :, pad:end])
        c.values = mx.contiguous(v[:, :, pad:end])
        c.offset = int(self.offset[b].item())
        c._idx = c.keys.shape[2]
        return c

    def size(self) -> int:
        return min(self._written, self.max_size)


def batch_caches(per_row: Sequence[Sequence]) -> list:
    """One batched cache per layer from each row's list of single-row caches."""
    if not per_row:
        return []
    out = []
    for layer in zip(*per_row):
        c0 = layer[0]
        if isinstance(c0, RotatingKVCache) and not c0.bits:
            out.append(BatchRotatingKVCache.from_caches(layer))
        elif isinstance(c0, KVCache) and not c0.bits:
            out.append(BatchKVCache.from_caches(layer))
        else:
            raise TypeError(f"{type(c0).__name__} cannot be batched here (quantized full-attention "
                            "caches: engine.kv.batch_quant.batch_caches_q)")
    return out


def extend_caches(a: list, b: list) -> list:
    if not a:
        return b
    if not b:
        return a
    for ca, cb in zip(a, b):
        ca.extend(cb)
    return a
