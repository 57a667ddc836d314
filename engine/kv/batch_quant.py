"""Quantized KV rows of the continuous batch: `BatchQuantizedKVCache`, the batched form of
`engine.kv.cache.QuantizedKVCache` (mlx-lm has no batched quantized cache: its server runs
quantized KV one request at a time).

Layout as `engine.kv.batch_cache.BatchKVCache` (B rows, left-padded, one write column), but
keys and values are each the (packed, scales, biases) triple `mx.quantize` gives, every part
[B, heads, T, x]; the batch cache's moves along the token axis (grow, roll, filter, pad) apply
to each part. A row's new keys and values are quantized as the row alone quantizes them
(groups along the head dimension: a row's values do not depend on the others), and attention
reads the row's columns under the batch's mask (the padding's zeros masked out), so on the CPU
a row's logits equal the same request decoding alone with a `QuantizedKVCache`
(tests/engine/test_batch_quant.py).

`quantize_group(caches, layers)` converts a group's float `BatchKVCache`s of the policy's
layers once they hold a token (the KV policy with `quantized_kv_start` 0: the alone path
converts after the first forward, prefill chunk or step, in the same place);
`batch_caches_q(per_row)` stacks per-row caches, quantized ones included.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from engine.kv.batch_cache import BatchKVCache, batch_caches
from engine.kv.batch_ops import each, pad_time
from engine.kv.cache import QuantizedKVCache

__all__ = ["BatchQuantizedKVCache", "quantize_group", "batch_caches_q"]


class BatchQuantizedKVCache(BatchKVCache):
    """A full-attention layer's batched cache over quantized K/V (see the module)."""

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(p.nbytes for p in self.keys + self.values)

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_float(cls, c: BatchKVCache, group_size: int, bits: int) -> "BatchQuantizedKVCache":
        """`c`'s rows quantized (as `KVCache.to_quantized` quantizes a row's buffer)."""
        out = cls([0], group_size, bits)
        out.__dict__.update({k: v for k, v in c.__dict__.items() if k not in ("keys", "values")})
        out.group_size, out.bits = group_size, bits
        if c.keys is not None:
            out.keys = mx.quantize(c.keys, group_size=group_size, bits=bits)
            out.values = mx.quantize(c.values, group_size=group_size, bits=bits)
        return out

    @classmethod
    def from_caches(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        """Stack single-row quantized caches (possibly empty), right-aligned."""
        ref = caches[0]
        sizes = [c.offset if c.keys is not None else 0 for c in caches]
        T = max(sizes)
        out = cls([T - s for s in sizes], ref.group_size, ref.bits)
        if T == 0:
            return out
        full = next(c for c in caches if c.keys is not None and c.offset)

        def stack(which):           # (an empty row: its columns all padding, shaped as full's)
            rows = [each(lambda x, s=s: pad_time(x[..., :s, :], T - s, 0),
                         getattr(c if s else full, which)) for c, s in zip(caches, sizes)]
            return each(lambda *xs: mx.concatenate(xs), *rows)
        out.keys, out.values = stack("keys"), stack("values")
        out.offset = out.offset + T
        out._idx = T
        return out

    # -- the model-facing protocol ------------------------------------------------
    def update_and_fetch(self, keys, values):
        start, n = self._idx, keys.shape[2]
        B, H = keys.shape[:2]
        if self.keys is None or start + n > self.keys[0].shape[2]:
            grow = (n + self.step - 1) // self.step * self.step
            nk = _empty(B, H, grow, keys.shape[3], keys.dtype, self.group_size, self.bits)
            nv = _empty(B, H, grow, values.shape[3], keys.dtype, self.group_size, self.bits)
            if self.keys is None:
                self.keys, self.values = nk, nv
            else:
                if start % self.step:
                    self.keys = each(lambda x: x[..., :start, :], self.keys)
                    self.values = each(lambda x: x[..., :start, :], self.values)
                grow_by = lambda a, b: mx.concatenate([a, b], axis=2)      # noqa: E731
                self.keys, self.values = each(grow_by, self.keys, nk), each(grow_by, self.values, nv)
        self._idx = start + n
        self.offset = self.offset + n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., start:self._idx, :] = qk[i]
            self.values[i][..., start:self._idx, :] = qv[i]
        cut = lambda x: x[..., :self._idx, :]          # noqa: E731
        return each(cut, self.keys), each(cut, self.values)

    def extract(self, b: int) -> QuantizedKVCache:
        """Row b as a single-row QuantizedKVCache (its real tokens only)."""
        pad = int(self.left_padding[b].item())
        c = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        c.keys = each(lambda x: mx.contiguous(x[b:b + 1, :, pad:self._idx]), self.keys)
        c.values = each(lambda x: mx.contiguous(x[b:b + 1, :, pad:self._idx]), self.values)
        c.offset = c.keys[0].shape[2]
        return c


def _empty(B, H, n, dim, dtype, group_size, bits):
    return (mx.zeros((B, H, n, dim * bits // 32), dtype=mx.uint32),
            mx.zeros((B, H, n, dim // group_size), dtype=dtype),
            mx.zeros((B, H, n, dim // group_size), dtype=dtype))


def quantize_group(caches: list, layers: dict) -> None:
    """In place: each float `BatchKVCache` of `layers` (cache index -> (bits, group size), a
    `KVPolicy`'s) that holds a token becomes a `BatchQuantizedKVCache`."""
    for i, (bits, group) in layers.items():
        c = caches[i]
        if type(c) is BatchKVCache and c.keys is not None:
            caches[i] = BatchQuantizedKVCache.from_float(c, group, bits)


def batch_caches_q(per_row: Sequence[Sequence]) -> list:
    """`engine.kv.batch_cache.batch_caches`, quantized single-row caches included."""
    if not per_row:
        return []
    layers = list(zip(*per_row))
    out = [None] * len(layers)
    plain = [i for i, layer in enumerate(layers) if not isinstance(layer[0], QuantizedKVCache)]
    for i, c in zip(plain, batch_caches([[row[i] for i in plain] for row in per_row])
                    if plain else []):
        out[i] = c
    for i, layer in enumerate(layers):
        if out[i] is None:
            out[i] = BatchQuantizedKVCache.from_caches(layer)
    return out
