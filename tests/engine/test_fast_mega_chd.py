"""The one-kernel step's hand-offs without a barrier (gate/up to down, CHD, and o_proj to
gate/up, CHC: engine.fast.mega_chd), mirrored: the split columns, the two counts the warps add (each reaches its
target exactly, and only once every column it stands for is written), and the split dot (every
lane adds the same products in the same order as over the whole row, so the result's bits do not
move). Each with a negative control."""

import numpy as np
import pytest

from engine.fast import mega_chd as CH
from engine.fast import mega_layout as L_


@pytest.mark.parametrize("inter,blocks,want", [(14336, 132, 12544), (8192, 132, 6144), (14336, 128, 12288),
                                               (8192, 114, 7168), (11008, 132, 10496), (14336, 1000, 0),
                                               (4096, 132, 0), (8200, 132, 0), (2048, 64, 1024)])
def test_split_column(inter, blocks, want):
    ks = CH.split_column(inter, blocks, L_.WPB)
    assert ks == want
    if ks:
        nw = blocks * L_.WPB
        rounds = -(-inter // nw)
        assert ks % CH.VEC_COLUMNS == 0 and nw <= ks <= nw * (rounds - 1) < inter


def chd_counts(I, NW, CHK, seed, fault=None):
    """Gate/up's units dealt in rounds (warp gw takes gw, gw + NW, ...), finishing at random
    times (in order within a warp); each warp adds to the two counters as mega_chd's CHD_D /
    CHD_E do. Returns (final counts, whether each count, when it reached its target, found
    every column it stands for written)."""
    rng = np.random.default_rng(seed)
    events = []                                 # (time, kind, warp, value)
    for gw in range(NW):
        units = list(range(gw, I, NW))
        t = rng.uniform(0, 1)
        below = sum(1 for n in units if n < CHK)
        for k, n in enumerate(units):
            start, t = t, t + rng.uniform(0.5, 1.5)
            events.append((t, "done", n, 0))
            if n < CHK and n + NW >= CHK:       # (CHD_D, after the unit's output is written)
                at = start if fault == "add_before_write" else t
                events.append((at + 1e-9, "c0", gw, k if fault == "off_by_one" else k + 1))
        if units and len(units) > below:        # (CHD_E, after the warp's last unit)
            events.append((t + 2e-9, "c1", gw, len(units) - below))
    done, c, ok = set(), [0, 0], [None, None]
    for _, kind, x, v in sorted(events):
        if kind == "done":
            done.add(x)
            continue
        i = 0 if kind == "c0" else 1
        c[i] += v
        if ok[i] is None and c[i] >= (CHK if i == 0 else I - CHK):
            cols = range(CHK) if i == 0 else range(CHK, I)
            ok[i] = all(n in done for n in cols)
    return c, ok


@pytest.mark.parametrize("I,blocks", [(14336, 132), (8192, 132), (14336, 128), (8192, 114), (2048, 2)])
def test_counts_reach_their_targets_only_when_the_columns_are_out(I, blocks):
    NW = blocks * L_.WPB
    CHK = CH.split_column(I, blocks, L_.WPB)
    assert CHK > 0
    for seed in range(3):
        c, ok = chd_counts(I, NW, CHK, seed)
        assert c == [CHK, I - CHK]              # exact: a wait for "at least" is not fooled
        assert ok == [True, True]
    # every warp has a unit below CHK: the first count says every block is past the norm
    assert all(gw < CHK for gw in range(NW))


@pytest.mark.parametrize("H,blocks,want", [(4096, 132, 2048), (2048, 132, 0), (4096, 114, 3584), (8192, 132, 6144),
                                           (5120, 132, 4096), (4000, 132, 0), (4096, 300, 0)])
def test_split_rows(H, blocks, want):
    ks = CH.split_rows(H, blocks, L_.WPB, 512)
    assert ks == want
    if ks:
        nw = blocks * L_.WPB
        assert ks % 512 == 0 and ks <= nw * (-(-H // nw) - 1) < H


@pytest.mark.parametrize("H,blocks", [(4096, 132), (4096, 114), (8192, 132), (5120, 132)])
def test_chc_counts_reach_their_targets_only_when_the_rows_are_out(H, blocks):
    """o_proj's rows counted as gate/up's units are (CHC_C / CHC_C_END: the same two adds)."""
    NW = blocks * L_.WPB
    CCK = CH.split_rows(H, blocks, L_.WPB, 512)
    for seed in range(3):
        c, ok = chd_counts(H, NW, CCK, seed)
        assert c == [CCK, H - CCK] and ok == [True, True]
    c, ok = chd_counts(H, NW, CCK, 0, fault="add_before_write")
    assert ok[0] is False


def test_counts_negative_controls():
    I, NW = 8192, 132 * L_.WPB
    CHK = CH.split_column(I, 132, L_.WPB)
    c, ok = chd_counts(I, NW, CHK, 0, fault="off_by_one")
    assert c[0] < CHK and ok[0] is None         # the wait would never end
    c, ok = chd_counts(I, NW, CHK, 0, fault="add_before_write")
    assert ok[0] is False                       # down would read columns not yet written


def lane_dot(w, x, parts, vec=8, fresh=False):
    """mega_dot on float32: lane l takes elements koff + ((i * 32 + l) * vec + j) of each part
    [koff, koff + K), adding in order (`fresh`: each part from zero, the lanes' part sums added
    after: a second part called with INIT); then the shuffle reduction (xor 16, 8, 4, 2, 1)."""
    total = np.zeros(32, np.float32)
    acc = np.zeros(32, np.float32)
    for koff, K in parts:
        assert koff % (32 * vec) == 0 and K % (32 * vec) == 0
        if fresh:
            acc = np.zeros(32, np.float32)
        for i in range(K // (32 * vec)):
            for lane in range(32):
                for j in range(vec):
                    e = koff + (i * 32 + lane) * vec + j
                    acc[lane] = np.float32(acc[lane] + np.float32(w[e] * x[e]))
        if fresh:
            total = np.float32(total + acc)
    acc = total if fresh else acc
    for o in (16, 8, 4, 2, 1):
        acc = np.float32(acc + acc[np.arange(32) ^ o])
    return acc[0]


def test_split_dot_is_bit_identical_and_restarting_the_sums_is_not():
    rng = np.random.default_rng(0)
    K, CHK = 2048, 1792
    same, moved = 0, 0
    for _ in range(6):
        w = rng.standard_normal(K).astype(np.float32)
        x = rng.standard_normal(K).astype(np.float32)
        whole = lane_dot(w, x, [(0, K)])
        same += whole.tobytes() == lane_dot(w, x, [(0, CHK), (CHK, K - CHK)]).tobytes()
        moved += whole.tobytes() != lane_dot(w, x, [(0, CHK), (CHK, K - CHK)], fresh=True).tobytes()
    assert same == 6
    assert moved >= 4
