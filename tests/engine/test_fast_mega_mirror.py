"""The one-kernel step's attention phase, mirrored in numpy loop for loop (engine.fast.mega_cuda,
phase B): the chunk size and count from the attended end, each (row, head, chunk) unit's
online softmax over 32-column sub-chunks clamped to the row's start column, the partials,
and the combine the last warp of a (row, head) does (its lanes sharing the chunks). Checked against plain softmax
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


def combine(parts, D):
    """The last warp's combine, lane by lane: lane l holds chunks l and l + 32 (max, sum),
    the warp's max and weighted sum by reduction, then every chunk's output weighted by the
    weight its owning lane holds (the shuffle from lane cc % 32, w0 below 32, w1 above)."""
    nch = len(parts)
    assert nch <= 64
    mc0 = [parts[l][0] if l < nch else -np.inf for l in range(32)]
    mc1 = [parts[l + 32][0] if l + 32 < nch else -np.inf for l in range(32)]
    l0 = [parts[l][1] if l < nch else 0.0 for l in range(32)]
    l1 = [parts[l + 32][1] if l + 32 < nch else 0.0 for l in range(32)]
    M = max(max(a, b) for a, b in zip(mc0, mc1))                      # mega_warp_max
    w0 = [0.0 if m == -np.inf else np.exp(m - M) for m in mc0]
    w1 = [0.0 if m == -np.inf else np.exp(m - M) for m in mc1]
    ls = sum(a * x + b * y for a, x, b, y in zip(w0, l0, w1, l1))    # mega_warp_sum
    acc = np.zeros(D)
    for c0 in range(0, nch, 8):                                       # CB = 8 chunks a round
        for j in range(8):
            cc = c0 + j
            wgt = (w0 if cc < 32 else w1)[cc & 31]
            if cc < nch:
                acc += wgt * parts[cc][2]
    return acc / ls if ls > 0 else np.zeros(D)


def mirror(q, K, V, scale, start, col, drop=0, maxch=C.MAXCH):
    aend = col + 1 - drop
    cs, nch = chunking(aend, maxch)
    parts = [unit(q, K, V, scale, max(c * cs, start), min(aend, c * cs + cs)) for c in range(nch)]
    return combine(parts, K.shape[1])


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


def test_combine_uses_every_chunk_once():
    """Negative control for the lane mapping: a combine that takes chunk cc's weight from the
    wrong lane (cc + 1) must move the result wherever there are several chunks, 1 to 64."""
    rng = np.random.default_rng(1)
    for nch in (1, 2, 31, 32, 33, 63, 64):
        parts = [(rng.standard_normal(), rng.random() + 0.5, rng.standard_normal(8)) for _ in range(nch)]
        M = max(p[0] for p in parts)
        w = [np.exp(p[0] - M) for p in parts]
        want = sum(wi * p[2] for wi, p in zip(w, parts)) / sum(wi * p[1] for wi, p in zip(w, parts))
        np.testing.assert_allclose(combine(parts, 8), want, rtol=1e-12)
        if nch > 1:
            shifted = [(parts[(c + 1) % nch][0], parts[c][1], parts[c][2]) for c in range(nch)]
            assert np.abs(combine(shifted, 8) - want).max() > 1e-6


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
