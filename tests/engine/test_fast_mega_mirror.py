"""The one-kernel step's attention phase, mirrored in numpy loop for loop (engine/fast/cuda/mega_attn.cu,
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


def flow_schedule(NQ: int, NKV: int, D: int, NW: int, nch: int, rows: int = 1):
    """FLOW, mirrored from the kernel: phase A's pair order (keys and values first:
    p = (u0 + NQ * HALF) % NPAIR, warp gw taking u0 = gw, gw + NW, ...), the flag each pair
    counts up (its head p // HALF), and phase B's unit order (warp gw taking u = NW - 1 - gw,
    + NW, ...). Returns (pairs per warp, flags per head, units per warp)."""
    HALF = D // 2
    NPAIR = (NQ + 2 * NKV) * HALF
    pairs = {gw: [(u0 + NQ * HALF) % NPAIR for u0 in range(gw, NPAIR, NW)] for gw in range(NW)}
    flags = [0] * (NQ + 2 * NKV)
    for ps in pairs.values():
        for p in ps:
            flags[p // HALF] += 1
    units = {gw: list(range(NW - 1 - gw, rows * NQ * nch, NW)) for gw in range(NW)}
    return pairs, flags, units


@pytest.mark.parametrize("NQ,NKV,D,NW,nch", [(32, 8, 128, 2112, 5), (32, 8, 64, 2112, 33),
                                             (32, 8, 128, 2112, 33), (16, 16, 64, 64, 64),
                                             (32, 8, 128, 100, 64)])
def test_flow_covers_every_pair_and_unit_once(NQ, NKV, D, NW, nch):
    """Every q/k/v pair computed once, every head's flag reaching exactly HALF (what an attention
    unit waits for), every attention unit taken once; keys and values come first; the first
    attention units go to the warps with the fewest pairs."""
    pairs, flags, units = flow_schedule(NQ, NKV, D, NW, nch)
    NPAIR = (NQ + 2 * NKV) * (D // 2)
    got = sorted(p for ps in pairs.values() for p in ps)
    assert got == list(range(NPAIR))
    assert flags == [D // 2] * (NQ + 2 * NKV)
    assert sorted(u for us in units.values() for u in us) == list(range(NQ * nch))
    first_round = [ps[0] for gw, ps in sorted(pairs.items()) if ps]
    kv = range(NQ * (D // 2), NPAIR)
    assert all(p in kv for p in first_round[:len(kv)])       # keys and values in the first round
    # where the units fit beside the warps that take one pair more (the first NPAIR % NW),
    # none of those warps gets a unit
    extra = NPAIR % NW
    if extra and NQ * nch <= NW - extra:
        assert all(not units[gw] for gw in range(extra))


def test_flow_flag_target_fails_for_a_wrong_order():
    """Negative control: a phase A order that skips a pair (u0 + 1) leaves a head's flag short
    of HALF, so its attention units would wait (the kernel traps after 10 s)."""
    NQ, NKV, D, NW = 32, 8, 128, 2112
    HALF, NPAIR = D // 2, (NQ + 2 * NKV) * (D // 2)
    flags = [0] * (NQ + 2 * NKV)
    for gw in range(NW):
        for u0 in range(gw, NPAIR, NW):
            flags[(min(u0 + 1, NPAIR - 1) + NQ * HALF) % NPAIR // HALF] += 1
    assert flags != [HALF] * (NQ + 2 * NKV)


def one_flag_counts(NQ: int, NKV: int, D: int, group=None):
    """FLOW's flags mirrored from engine/fast/cuda/mega_qkv.cu's head_done: one flag per query head; a q head's
    pair adds to its own, a k or v head's pair to each of the NQ/NKV query heads of its group.
    Returns the flags after phase A (every pair counted once)."""
    HALF, G = D // 2, NQ // NKV
    group = group or (lambda h: (h - NQ) % NKV)
    flags = [0] * NQ
    for head in range(NQ + 2 * NKV):
        for _ in range(HALF):
            if head < NQ:
                flags[head] += 1
            else:
                for j in range(G):
                    flags[group(head) * G + j] += 1
    return flags


@pytest.mark.parametrize("NQ,NKV,D", [(32, 8, 128), (32, 8, 64), (16, 16, 64), (64, 1, 64)])
def test_one_flag_per_query_head_reaches_the_wait_target(NQ, NKV, D):
    """Each query head's flag ends at what its attention units wait for (3 D/2), and only once
    its own, its key head's and its value head's pairs are all in."""
    HALF, G = D // 2, NQ // NKV
    assert one_flag_counts(NQ, NKV, D) == [3 * HALF] * NQ
    # the heads a query head hq waits on, as the attention phase maps them (g = hq / G)
    for hq in (0, NQ - 1):
        g = hq // G
        assert {hq, NQ + g, NQ + NKV + g} == {h for h in range(NQ + 2 * NKV)
                                              if h == hq or (h >= NQ and (h - NQ) % NKV == g)}


def test_one_flag_negative_control():
    """A kernel that mapped a k/v head to the wrong group of query heads (its index divided by
    NKV instead of taken modulo) leaves flags short of the target and others over it."""
    flags = one_flag_counts(32, 8, 128, group=lambda h: (h - 32) // 8)
    assert flags != [3 * 64] * 32
