"""engine.kv.crc: the CRC-32 of a buffer from its pieces' CRCs, combined (zlib's value for the
whole, so files written before read the same), on a pool of threads."""

import os
import random
import zlib

import pytest

from engine.kv.crc import crc32, crc32_combine


def test_combine_equals_zlib_over_the_joined_bytes():
    rng = random.Random(0)
    for _ in range(300):
        a, b = os.urandom(rng.randint(0, 3000)), os.urandom(rng.randint(0, 3000))
        seed = rng.randint(0, 2**32 - 1)
        assert crc32_combine(zlib.crc32(a, seed), zlib.crc32(b), len(b)) == zlib.crc32(a + b, seed)
    a, b = b"x" * 100, b"y" * 100          # (a control: the length matters)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), 99) != zlib.crc32(a + b)


@pytest.mark.parametrize("n", [0, 1, 100, 10_000, 100_003])
@pytest.mark.parametrize("piece", [7, 64, 4096])
def test_pieces_give_zlibs_value(n, piece):
    data = os.urandom(n)
    assert crc32(data, 5, piece) == zlib.crc32(data, 5)
    assert crc32(memoryview(data), 0, piece) == zlib.crc32(data)
    if n > 2 * piece:                   # (a byte altered in a late piece changes it)
        bad = bytearray(data)
        bad[-1] ^= 1
        assert crc32(bytes(bad), 5, piece) != zlib.crc32(data, 5)
