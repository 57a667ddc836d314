"""CRC-32 over a large buffer on several threads: the pieces' CRCs combined into the whole's.

A disk prompt cache restore checks the file's CRC-32 while its arrays are copied into MLX's
memory. On the H100 host zlib's CRC ran at 4.8 GB/s on one thread and 28.7 GB/s over 32 MB
pieces on 8 (`experiments/restore_bound_probe.py`): once the copy is fast (into buffers MLX
kept, 11.7 GB/s) one CRC thread would be what the restore waits for. `crc32` gives exactly
zlib's value for the whole buffer (the file format is unchanged): each piece's CRC is taken
from zero and joined to the running one with zlib's combine method (multiplying by x^(8·len)
modulo the polynomial, by squaring).
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Optional

PIECE = 32 << 20        # bytes a thread checks at a time
POLY = 0xEDB88320       # CRC-32's polynomial, bit-reflected
_POOL: Optional[ThreadPoolExecutor] = None
_LOCK = threading.Lock()


def _mul(a: int, b: int) -> int:
    """a·b modulo the polynomial (reflected bit order)."""
    p = 0
    for _ in range(32):
        if a & 0x80000000:
            p ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


_SQUARES = [1 << 30]            # x^(2^k) for k = 0..63 (x^1 is bit 30 when reflected)
for _ in range(63):
    _SQUARES.append(_mul(_SQUARES[-1], _SQUARES[-1]))


@lru_cache(maxsize=8)
def _shift(n_bytes: int) -> int:
    """x^(8·n_bytes) modulo the polynomial (cached: a buffer's pieces share one length)."""
    p, k, n = 1 << 31, 3, n_bytes        # 1 << 31: x^0; 2^3 = 8 bits a byte
    while n:
        if n & 1:
            p = _mul(_SQUARES[k], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B)."""
    return _mul(_shift(len2), crc1) ^ crc2 if len2 > 0 else crc1


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)),
                                       thread_name_prefix="crc32")
        return _POOL


def crc32(data, seed: int = 0, piece: int = PIECE) -> int:
    """zlib.crc32(data, seed) of a bytes-like object, over pieces on a pool of threads when
    it spans more than two pieces (zlib lets go of the GIL while it runs)."""
    view = memoryview(data).cast("B")
    n = len(view)
    if n <= 2 * piece:
        return zlib.crc32(view, seed)
    bounds = [(a, min(a + piece, n)) for a in range(0, n, piece)]
    crcs = _pool().map(lambda ab: zlib.crc32(view[ab[0]:ab[1]]), bounds)
    crc = seed
    for (a, b), c in zip(bounds, crcs):
        crc = crc32_combine(crc, c, b - a)
    return crc
