"""KV caches: growing, rotating (sliding window), quantized, rotating-quantized.

The storage layout and growth policy (256-slot steps, the rotating buffer's
temporal re-ordering on multi-token writes) follow mlx-lm's cache classes on
purpose: the slices handed to attention must be the same shapes, in the same
order, for logits to agree bit for bit. K/V are [B, heads, T, head_dim];
quantized K/V are (packed uint32, scales, biases) tuples along head_dim.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from engine.kv.masks import causal_mask


def _mask_for(n: int, offset: int, window: Optional[int], return_array: bool = False):
    if window is not None:
        return causal_mask(n, offset, window=window)
    if n == 1:
        return None
    if return_array:
        return causal_mask(n, offset)
    return "causal"


def _tmap(fn, *trees):
    """Apply fn leafwise over arrays or (packed, scales, biases) tuples."""
    if isinstance(trees[0], (tuple, list)):
        return tuple(fn(*leaves) for leaves in zip(*trees))
    return fn(*trees)


def _nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (tuple, list)):
        return sum(a.nbytes for a in x)
    return x.nbytes


class KVCache:
    """Growing cache for full-attention layers."""

    step = 256
    bits = None

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or prev + keys.shape[2] > self.keys.shape[2]:
            B, H, _, dk = keys.shape
            dv = values.shape[3]
            n = (self.step + keys.shape[2] - 1) // self.step * self.step
            new_k = mx.zeros((B, H, n, dk), keys.dtype)
            new_v = mx.zeros((B, H, n, dv), values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.fetch()

    def fetch(self):
        if self.offset < self.keys.shape[2]:
            return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, n: int, window_size: Optional[int] = None, return_array: bool = False):
        return _mask_for(n, self.offset, window_size, return_array)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKVCache":
        q = QuantizedKVCache(group_size=group_size, bits=bits)
        q.offset = self.offset
        if self.keys is not None:
            q.keys = mx.quantize(self.keys, group_size=group_size, bits=bits)
            q.values = mx.quantize(self.values, group_size=group_size, bits=bits)
        return q

    def copy(self):
        c = type(self).__new__(type(self))
        c.__dict__.update(self.__dict__)
        return c

    def head(self, n: int) -> "KVCache":
        """A new cache holding only the first n tokens, in buffers of exactly n slots
        (copies, evaluated; the cache must be trimmable)."""
        c = self.copy()
        c.offset = min(n, self.offset)
        if self.keys is not None:
            cut = lambda x: mx.contiguous(x[..., :c.offset, :])
            c.keys, c.values = _tmap(cut, self.keys), _tmap(cut, self.values)
            mx.eval(c.keys, c.values)
        return c

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)


class QuantizedKVCache(KVCache):
    """Growing cache holding affine-quantized K/V (`mx.quantize`, bits 4/8)."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        super().__init__()
        self.group_size = group_size
        self.bits = bits

    def _empty(self, B, H, n, dim, dtype):
        per_word = 32 // self.bits
        return (
            mx.zeros((B, H, n, dim // per_word), dtype=mx.uint32),
            mx.zeros((B, H, n, dim // self.group_size), dtype=dtype),
            mx.zeros((B, H, n, dim // self.group_size), dtype=dtype),
        )

    def update_and_fetch(self, keys, values):
        B, H, S, dk = keys.shape
        dv = values.shape[-1]
        prev = self.offset
        if self.keys is None or prev + S > self.keys[0].shape[-2]:
            n = (self.step + S - 1) // self.step * self.step
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = (
                        _tmap(lambda x: x[..., :prev, :], self.keys),
                        _tmap(lambda x: x[..., :prev, :], self.values),
                    )
                grow = lambda x: mx.concatenate(
                    [x, mx.zeros((B, H, n, x.shape[-1]), dtype=x.dtype)], axis=-2)
                self.keys = _tmap(grow, self.keys)
                self.values = _tmap(grow, self.values)
            else:
                self.keys = self._empty(B, H, n, dk, keys.dtype)
                self.values = self._empty(B, H, n, dv, keys.dtype)
        self.offset += S
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self.offset, :] = qk[i]
            self.values[i][..., prev:self.offset, :] = qv[i]
        return self.fetch()

    def fetch(self):
        if self.offset == self.keys[0].shape[2]:
            return self.keys, self.values
        cut = lambda x: x[..., :self.offset, :]
        return _tmap(cut, self.keys), _tmap(cut, self.values)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return self


class RotatingKVCache(KVCache):
    """Fixed-size ring buffer for sliding-window layers (keeps the last `max_size`
    tokens, plus `keep` sink tokens at the front).

    A multi-token write first restores temporal order and keeps `max_size - 1`
    old tokens so every new query still sees a full window; single-token writes
    go in place and wrap. A `temporal` cache (deterministic mode, `temporal_caches`)
    writes every token the multi-token way, so attention always reads the window oldest
    first, whatever the write history (the CPU's attention rounds by key order)."""

    temporal = False

    def __init__(self, max_size: int, keep: int = 0):
        super().__init__()
        self.keep = keep
        self.max_size = max_size
        self._idx = 0

    # storage helpers (overridden by the quantized form)
    def _len(self, x) -> int:
        return x.shape[2]

    def _cat(self, parts):
        return mx.concatenate(parts, axis=2)

    def _slice(self, x, a, b=None):
        return x[..., a:b, :]

    def _alloc(self, B, H, n, dim, dtype):
        return mx.zeros((B, H, n, dim), dtype)

    def _write(self, buf, new, a, b):
        buf[..., a:b, :] = new

    def _encode(self, x):
        return x

    def _trim(self, trim, v, append=None):
        parts = [self._slice(v, 0, self.keep), self._slice(v, trim + self.keep)] if trim > 0 else [v]
        if append is not None:
            parts.append(append)
        return parts[0] if len(parts) == 1 else self._cat(parts)

    def temporal_order(self, v):
        n = self._len(v)
        if self._idx == n:
            return v
        if self._idx < self.offset:
            return self._cat([self._slice(v, 0, self.keep), self._slice(v, self._idx),
                              self._slice(v, self.keep, self._idx)])
        return self._slice(v, 0, self._idx)

    def _update_concat(self, keys, values):
        keys, values = self._encode(keys), self._encode(values)
        S = self._len(keys)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = self.temporal_order(self.keys)
            self.values = self.temporal_order(self.values)
            self._idx = self._len(self.keys)
            trim = self._idx - self.max_size + 1
            self.keys = self._trim(trim, self.keys, keys)
            self.values = self._trim(trim, self.values, values)
        self.offset += S
        self._idx = self._len(self.keys)
        return self.fetch()

    def _update_in_place(self, keys, values):
        B, H, S, dk = keys.shape
        prev = self.offset
        if self.keys is None or (prev >= self._len(self.keys) and self._len(self.keys) < self.max_size):
            n = min(self.step, self.max_size - prev)
            new_k = self._alloc(B, H, n, dk, keys.dtype)
            new_v = self._alloc(B, H, n, values.shape[3], values.dtype)
            if self.keys is not None:
                self.keys = self._cat([self.keys, new_k])
                self.values = self._cat([self.values, new_v])
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev
        trim = self._len(self.keys) - self.max_size
        if trim > 0:
            self.keys = self._trim(trim, self.keys)
            self.values = self._trim(trim, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        self._write(self.keys, self._encode(keys), self._idx, self._idx + S)
        self._write(self.values, self._encode(values), self._idx, self._idx + S)
        self.offset += S
        self._idx += S
        return self.fetch()

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1 and not self.temporal:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def fetch(self):
        if self.offset < self._len(self.keys):
            return self._slice(self.keys, 0, self.offset), self._slice(self.values, 0, self.offset)
        return self.keys, self.values

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def head(self, n: int) -> "RotatingKVCache":
        if not self.is_trimmable():
            raise ValueError("a wrapped sliding-window ring cannot be cut to a prefix")
        c = super().head(n)
        c._idx = c.offset   # not wrapped: slot i holds token i
        return c

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    def make_mask(self, n: int, window_size: Optional[int] = None, return_array: bool = False):
        if self.temporal and n == 1:   # (the window oldest first: no wrap)
            offset = min(self.max_size - 1, self.offset)
            if window_size is not None and offset + 1 > window_size:
                return causal_mask(1, offset, window=window_size)
            return None
        if n > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + n > window_size or return_array:
                return causal_mask(n, offset, window=window_size)
            return "causal"
        if window_size is None:
            return None
        # A window smaller than the buffer needs an explicit (rolled) mask.
        if self.offset >= window_size and self.max_size > window_size:
            idx = 0 if self._idx >= self.max_size else self._idx
            size = self.offset + 1 if self.offset < self.max_size else self.max_size
            return mx.roll(mx.arange(size) >= (size - window_size), shift=idx + 1)
        return None

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "RotatingQuantizedKVCache":
        q = RotatingQuantizedKVCache(self.max_size, self.keep, group_size, bits)
        if self.keys is not None:
            q.keys = mx.quantize(self.keys, group_size=group_size, bits=bits)
            q.values = mx.quantize(self.values, group_size=group_size, bits=bits)
        q.offset = self.offset
        q._idx = self._idx
        q.temporal = self.temporal
        return q


class RotatingQuantizedKVCache(RotatingKVCache):
    """Sliding-window ring buffer over quantized K/V (mlx-lm has none; this is
    the L2 tier, checked against mlx-optiq's RotatingQuantizedKVCache)."""

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 4):
        super().__init__(max_size, keep)
        self.group_size = group_size
        self.bits = bits

    def _len(self, x) -> int:
        return x[0].shape[2]

    def _cat(self, parts):
        return tuple(mx.concatenate(leaves, axis=2) for leaves in zip(*parts))

    def _slice(self, x, a, b=None):
        return tuple(t[..., a:b, :] for t in x)

    def _alloc(self, B, H, n, dim, dtype):
        per_word = 32 // self.bits
        return (
            mx.zeros((B, H, n, dim // per_word), dtype=mx.uint32),
            mx.zeros((B, H, n, dim // self.group_size), dtype=dtype),
            mx.zeros((B, H, n, dim // self.group_size), dtype=dtype),
        )

    def _write(self, buf, new, a, b):
        for i in range(3):
            buf[i][..., a:b, :] = new[i]

    def _encode(self, x):
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return self


def quantize_layer_cache(cache, bits: int, group_size: int):
    """The quantized form of one layer's cache (a no-op if already quantized)."""
    if cache.bits:
        return cache
    return cache.to_quantized(group_size=group_size, bits=bits)


def make_cache(model, kv_bits: Optional[int] = None, kv_group_size: int = 64):
    """The model's per-layer caches; with kv_bits, quantized from the first token
    (use the generation loop's `quantized_kv_start` to convert later instead)."""
    caches = model.make_cache()
    if kv_bits is None:
        return caches
    if kv_bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"kv_bits must be one of 2,3,4,5,6,8 (got {kv_bits})")
    if kv_group_size not in (32, 64, 128):
        raise ValueError(f"kv_group_size must be 32, 64 or 128 (got {kv_group_size})")
    out = []
    for c in caches:
        if isinstance(c, RotatingKVCache):
            out.append(RotatingQuantizedKVCache(c.max_size, c.keep, kv_group_size, kv_bits))
        else:
            out.append(QuantizedKVCache(kv_group_size, kv_bits))
    return out


def temporal_caches(caches: list) -> list:
    """Deterministic mode: the sliding-window caches among `caches` keep their window in
    temporal order (`RotatingKVCache.temporal`); returns `caches`."""
    for c in caches:
        if isinstance(c, RotatingKVCache):
            c.temporal = True
    return caches


def cache_nbytes(caches) -> int:
    return sum(c.nbytes for c in caches)
