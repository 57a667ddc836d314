"""The one-kernel step's attention phase, mirrored in numpy loop for loop (engine.fast.mega_cuda,
phase B): the chunk size and count from the attended end, each (row, head, chunk) unit's
online softmax over 32-column sub-chunks clamped to the row's start column, the partials,
and the combine the last warp of a (row, head) does. Checked against plain softmax
attention over each row's columns [start, end), for rows with different left padding, the
DROP fault (the newest key left out), and lengths that leave chunks empty."""

import numpy as np
import pytest

from engine.fast import mega_cuda as C


def chunking(aend: int, maxch: int = C.MAXCH):
    """(cs, nch) as the kernel computes them."""
    cs = 32 * max(1, (max(aend, 1) + 32 * maxch - 1) // (32 * maxch))
    nch = (max(aend, 1) + cs - 1) // cs
    return cs, nch


def unit(q, K, V, scale, start, end):
    """One warp's (max, sum, output) over columns [start, end), 32 at a time."""
    m, lsum, o = -np.inf, 0.0, np.zeros(K.shape[1])
    for p0 in range(start, end, 32):
        cols = np.arange(p0, min(p0 + 32, end))
        sc = (K[cols] @ q) * scale
        mn = max(m, sc.max())
        p = np.exp(sc - mn)
        corr = np.exp(m - mn)
        lsum = lsum * corr + p.sum()
        o = o * corr + p @ V[cols]
        m = mn
    return m, lsum, o


def mirror(q, K, V, scale, start, col, drop=0, maxch=C.MAXCH):
    aend = col + 1 - drop
    cs, nch = chunking(aend, maxch)
    parts = [unit(q, K, V, scale, max(c * cs, start), min(aend, c * cs + cs)) for c in range(nch)]
    M = max(p[0] for p in parts)
    w = [0.0 if p[0] == -np.inf else np.exp(p[0] - M) for p in parts]
    ls = sum(wi * p[1] for wi, p in zip(w, parts))
    acc = sum(wi * p[2] for wi, p in zip(w, parts))
    return acc / ls if ls > 0 else np.zeros(K.shape[1])


def reference(q, K, V, scale, start, end):
    if end <= start:
        return np.zeros(K.shape[1])
    sc = (K[start:end] @ q) * scale
    p = np.exp(sc - sc.max())
    return (p / p.sum()) @ V[start:end]


@pytest.mark.parametrize("col,start,drop,maxch", [
    (0, 0, 0, 64), (31, 0, 0, 64), (32, 0, 0, 64), (127, 5, 0, 64), (130, 97, 0, 64),
    (2047, 0, 0, 64), (2047, 1500, 1, 64), (300, 0, 0, 2), (300, 290, 0, 2), (5000, 17, 0, 64)])
def test_chunked_attention_matches_softmax(col, start, drop, maxch):
    rng = np.random.default_rng(col + start)
    D = 64
    K = rng.standard_normal((col + 1, D))
    V = rng.standard_normal((col + 1, D))
    q = rng.standard_normal(D)
    got = mirror(q, K, V, D ** -0.5, start, col, drop, maxch)
    want = reference(q, K, V, D ** -0.5, start, col + 1 - drop)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_chunks_stay_within_the_partials_buffer():
    for aend in (1, 31, 32, 33, 2047, 2048, 2049, 32 * C.MAXCH + 1, 100_000):
        cs, nch = chunking(aend)
        assert cs % 32 == 0 and 1 <= nch <= C.MAXCH and (nch - 1) * cs < max(aend, 1) <= nch * cs


def test_the_drop_fault_changes_the_output():
    """Negative control: leaving out the newest key moves the result."""
    rng = np.random.default_rng(0)
    K, V, q = rng.standard_normal((65, 64)), rng.standard_normal((65, 64)), rng.standard_normal(64)
    a = mirror(q, K, V, 0.125, 0, 64)
    b = mirror(q, K, V, 0.125, 0, 64, drop=1)
    assert np.abs(a - b).max() > 1e-3
