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


def pre_events(pre: int, NQ: int, NKV: int, D: int, H: int, I: int, V: int, L: int, NW: int,
               gw: int, flow: bool = True, one_slot: bool = False):
    """MLXP_MEGA_PRE mirrored for warp gw from the kernel (mega_cuda.py, mega_qkv.py): the
    copies it asks for ('pre', slot, matrix, rows) and the units that use them ('use', slot,
    matrix, rows; slot None: loaded then). Slot of the k-th unit of a phase: k % 2 (PRE 2), 0."""
    HALF, NPAIR = D // 2, (NQ + 2 * NKV) * (D // 2)
    ev = []
    slot = (lambda k: k % 2) if pre == 2 and not one_slot else (lambda k: 0)

    def qrow(u0):
        p = (u0 + NQ * HALF) % NPAIR if flow else u0
        return (p // HALF) * D + p % HALF

    def units(name, N, rows_of, first):
        for k, n in enumerate(range(first, N, NW)):
            more = n + NW < N
            if pre == 2 and more:
                ev.append(("pre", slot(k + 1), name, rows_of(n + NW)))
            ev.append(("use", slot(k) if (k == 0 or pre == 2) else None, name, rows_of(n)))

    pair = lambda m, off: (lambda n: (m, (n, n + off)))
    if gw < NPAIR:
        ev.append(("pre", slot(0), "qkv0", (qrow(gw), qrow(gw) + HALF)))
    for l in range(L):
        units(f"qkv{l}", NPAIR, lambda u0: (qrow(u0), qrow(u0) + HALF), gw)
        if gw < H:
            ev.append(("pre", slot(0), f"o{l}", (gw,)))
        units(f"o{l}", H, lambda n: (n,), gw)
        if gw < I:
            ev.append(("pre", slot(0), f"gu{l}", (gw, I + gw)))
        units(f"gu{l}", I, lambda n: (n, I + n), gw)
        if gw < H:
            ev.append(("pre", slot(0), f"d{l}", (gw,)))
        units(f"d{l}", H, lambda n: (n,), gw)
        if l + 1 < L and gw < NPAIR:
            ev.append(("pre", slot(0), f"qkv{l + 1}", (qrow(gw), qrow(gw) + HALF)))
        elif l + 1 == L and gw < V:
            ev.append(("pre", slot(0), "head", (gw,)))
    units("head", V, lambda n: (n,), gw)
    return ev


def check_pre(ev) -> None:
    """Every unit that reads a slot reads the rows last copied into it, each copy is read
    exactly once, and (PRE 2) at most the next unit's copy is pending beside the current."""
    held = {}
    for kind, s, m, rows in ev:
        if kind == "pre":
            assert s not in held, f"slot {s} overwritten before use: {held[s]} by {(m, rows)}"
            held[s] = (m, rows)
        elif s is not None:
            assert held.pop(s, None) == (m, rows), (s, m, rows)
    assert not held, held


@pytest.mark.parametrize("pre", [1, 2, 3])
@pytest.mark.parametrize("gw", [0, 5, 959, 960, 2047, 2111])
def test_preloads_are_used_by_the_units_they_were_for(pre, gw):
    # 8b shape (32 q heads of 128, 8 kv heads, H 4096, I 14336) on 132 blocks of 16 warps
    ev = pre_events(pre, 32, 8, 128, 4096, 14336, 128256, 2, 2112, gw)
    check_pre(ev)
    uses = [e for e in ev if e[0] == "use"]
    if pre in (1, 3):                # the first unit of each phase from the copy, the rest loaded
                                     # (3: the copy in registers, one set as 1's one slot)
        assert all((e[1] is None) == (i > 0) for i, e in
                   enumerate([e for e in uses if e[2] == "gu0"]))
    else:                            # every unit from a copy
        assert all(e[1] is not None for e in uses)


def test_a_skipped_preload_or_a_shared_slot_is_caught():
    """Negative controls: a kernel that forgot the copy before the o_proj phase, or one that
    gave PRE 2 a single slot (the next unit's copy overwriting the current one's), fails."""
    ev = pre_events(2, 32, 8, 128, 4096, 14336, 128256, 1, 2112, 7)
    ev = [e for e in ev if not (e[0] == "pre" and e[2] == "o0" and e[3] == (7,))]
    with pytest.raises(AssertionError):
        check_pre(ev)
    with pytest.raises(AssertionError, match="overwritten"):
        check_pre(pre_events(2, 32, 8, 128, 4096, 14336, 128256, 1, 2112, 7, one_slot=True))


def qrow_used(NQ: int, NKV: int, D: int, NW: int) -> bool:
    """QROW's condition, as the kernel has it: rows take fewer rounds than pairs."""
    npair = (NQ + 2 * NKV) * (D // 2)
    return -(-2 * npair // NW) < 2 * -(-npair // NW)


def qrow_layers(NQ: int, NKV: int, D: int, NW: int, L: int, seed: int, partner=None, second=None):
    """QROW mirrored from the kernel (mega_qkv.py) over L layers: warp gw takes rows
    t = gw, gw + NW, ... (FLOW order: r = (t + NQ D) % NROW); rows finish in a random order;
    a q/k row leaves its value and adds 1 to its pair's counter (pcnt, kept over the layers);
    the row that reads 2 l + 1 takes its partner's value and writes the rotated pair; a value row
    and each rotated pair count up their head's flag. Returns per layer {pair: (x1, x2)} written
    and the flags. `partner` / `second` replace the partner row / the counter test (negative
    controls)."""
    HALF, NROW = D // 2, 2 * (NQ + 2 * NKV) * (D // 2)
    rng = np.random.default_rng(seed)
    pcnt = [0] * ((NQ + NKV) * HALF)
    partner = partner or (lambda i: i + HALF if i < HALF else i - HALF)
    second = second or (lambda old, l: old == 2 * l + 1)
    out = []
    for l in range(L):
        rows = [(t + NQ * D) % NROW for gw in range(NW) for t in range(gw, NROW, NW)]
        assert sorted(rows) == list(range(NROW))
        value = {r: float(1000 * l + r) for r in rows}     # the row's dot product, any distinct value
        slot, written, flags = {}, {}, [0] * (NQ + 2 * NKV)
        for r in rng.permutation(rows):
            head, i = divmod(int(r), D)
            if head >= NQ + NKV:
                flags[head] += 1
                continue
            slot[(head, i)] = value[r]
            u = head * HALF + i % HALF
            old, pcnt[u] = pcnt[u], pcnt[u] + 1
            if second(old, l):
                y = slot.get((head, partner(i)))
                assert y is not None, f"layer {l} pair {u}: the other row's value is not there yet"
                x = value[r]
                pair = (x, y) if i < HALF else (y, x)
                assert u not in written, f"layer {l} pair {u} rotated twice"
                written[u] = pair
                flags[head] += 1
        out.append((written, flags))
    return out


@pytest.mark.parametrize("NQ,NKV,D,NW,L", [(32, 8, 128, 2112, 3), (16, 16, 64, 64, 2), (32, 8, 128, 100, 2)])
def test_qrow_rotates_every_pair_once_with_both_rows(NQ, NKV, D, NW, L):
    """Every q/k pair rotated exactly once a layer, from its own two rows in order (row i, row
    i + D/2), whatever order the rows finish in; the q and k flags reach D/2, the value flags D
    (what an attention unit waits for with QROW)."""
    HALF = D // 2
    for seed in range(3):
        for l, (written, flags) in enumerate(qrow_layers(NQ, NKV, D, NW, L, seed)):
            assert sorted(written) == list(range((NQ + NKV) * HALF))
            for u, (x1, x2) in written.items():
                head, i = divmod(u, HALF)
                assert (x1, x2) == (1000 * l + head * D + i, 1000 * l + head * D + i + HALF)
            assert flags == [HALF] * (NQ + NKV) + [D] * NKV


def test_qrow_negative_controls():
    """A kernel that took the wrong partner row, or tested the counter without the layer's
    offset (old == 1), fails the mirror."""
    with pytest.raises(AssertionError):
        for written, _ in qrow_layers(4, 2, 16, 8, 1, 0, partner=lambda i: (i + 1) % 16):
            for u, (x1, x2) in written.items():
                head, i = divmod(u, 8)
                assert (x1, x2) == (head * 16 + i, head * 16 + i + 8)
    with pytest.raises(AssertionError):
        for _, flags in qrow_layers(4, 2, 16, 8, 2, 0, second=lambda old, l: old == 1):
            assert flags == [8] * 6 + [16] * 2


def test_qrow_where_it_takes_fewer_rounds():
    """On 132 blocks of 16 warps: the 8B shape (3072 pairs: 2 rounds of pairs, 3 of rows) takes
    QROW, the 1B shape (1536 pairs: 1 round) keeps pairs; the condition counts rows per round."""
    assert qrow_used(32, 8, 128, 2112)
    assert not qrow_used(32, 8, 64, 2112)
    assert not qrow_used(32, 8, 128, 3072)          # (as many warps as pairs: one round)


def one_flag_counts(NQ: int, NKV: int, D: int, qrow: bool, group=None):
    """STG's FLOW flags mirrored from mega_qkv.py's head_done: one flag per query head; a q
    head's pair adds to its own, a k or v head's pair (QROW: a v row) to each of the NQ/NKV
    query heads of its group. Returns the flags after phase A (every pair / row counted once)."""
    HALF, G = D // 2, NQ // NKV
    group = group or (lambda h: (h - NQ) % NKV)
    flags = [0] * NQ
    for head in range(NQ + 2 * NKV):
        count = D if (qrow and head >= NQ + NKV) else HALF
        for _ in range(count):
            if head < NQ:
                flags[head] += 1
            else:
                for j in range(G):
                    flags[group(head) * G + j] += 1
    return flags


@pytest.mark.parametrize("NQ,NKV,D", [(32, 8, 128), (32, 8, 64), (16, 16, 64), (64, 1, 64)])
@pytest.mark.parametrize("qrow", [False, True])
def test_one_flag_per_query_head_reaches_the_wait_target(NQ, NKV, D, qrow):
    """Each query head's flag ends at what its attention units wait for (2 D/2 + D/2, QROW
    2 D/2 + D), and only once its own, its key head's and its value head's pairs are all in:
    leaving out any one pair of those heads keeps it short."""
    HALF, G = D // 2, NQ // NKV
    target = 2 * HALF + (D if qrow else HALF)
    assert one_flag_counts(NQ, NKV, D, qrow) == [target] * NQ
    # the heads a query head hq waits on, as the attention phase maps them (g = hq / G)
    for hq in (0, NQ - 1):
        g = hq // G
        assert {hq, NQ + g, NQ + NKV + g} == {h for h in range(NQ + 2 * NKV)
                                              if h == hq or (h >= NQ and (h - NQ) % NKV == g)}


def test_one_flag_negative_control():
    """A kernel that mapped a k/v head to the wrong group of query heads (its index divided by
    NKV instead of taken modulo) leaves flags short of the target and others over it."""
    flags = one_flag_counts(32, 8, 128, False, group=lambda h: (h - 32) // 8)
    assert flags != [3 * 64] * 32


def dyn_units(N: int, NW: int, seed: int, dyn: bool = True, offset=None):
    """DYN mirrored from mega_cuda.py (dyn_ns / dyn_ask / dyn_next): warps of random speeds
    (an event queue in time); a warp asks its counter (gw % 8) at the start of its last static
    unit and of each counted one, in the order the asks reach the counters, and takes unit
    NS + gw % 8 + 8 j for answer j. Returns the units each warp took, in order."""
    import heapq
    rng = np.random.default_rng(seed)
    r = N // NW
    NS = min(N, max(r - 1, 1) * NW) if dyn else N
    offset = offset or (lambda gw, j: NS + gw % 8 + 8 * j)
    ctr = [0] * 8
    speed = rng.uniform(0.8, 1.25, NW)
    taken = {gw: [] for gw in range(NW)}
    queue = [(0.0, gw, gw) for gw in range(NW) if gw < N]      # (time, warp, its unit)
    heapq.heapify(queue)
    while queue:
        t, gw, n = heapq.heappop(queue)
        ask = NS < N and n + NW >= NS
        got = None
        if ask:
            got, ctr[gw % 8] = ctr[gw % 8], ctr[gw % 8] + 1
        taken[gw].append(n)
        nxt = offset(gw, got) if ask else n + NW
        if nxt < N:
            heapq.heappush(queue, (t + speed[gw] * (1 + rng.random() * 0.1), gw, nxt))
    return taken, NS


@pytest.mark.parametrize("N,NW", [(14336, 2112), (4096, 2112), (128256, 2112), (2048, 2112),
                                  (6144, 2112), (8192, 2112), (100, 16), (17, 16)])
def test_dyn_takes_every_unit_once(N, NW):
    """Every unit of a phase computed exactly once, the first round static (warp gw's first unit
    is gw: the one the previous phase's prefetch and PRE copies are for), the static part whole
    rounds; with DYN off every warp takes gw, gw + NW, ..."""
    for seed in range(2):
        taken, NS = dyn_units(N, NW, seed)
        units = sorted(u for us in taken.values() for u in us)
        assert units == list(range(N))
        assert all(us[0] == gw for gw, us in taken.items() if us)
        assert NS % NW == 0 or NS == N
    off, _ = dyn_units(N, NW, 0, dyn=False)
    assert all(us == list(range(gw, N, NW)) for gw, us in off.items())


def test_dyn_balances_the_last_rounds():
    """The warps that stream faster take more of the counted units (what DYN is for)."""
    taken, NS = dyn_units(14336, 2112, 3)
    rng = np.random.default_rng(3)
    speed = rng.uniform(0.8, 1.25, 2112)
    fast = [len(taken[g]) for g in range(2112) if speed[g] < 0.9]
    slow = [len(taken[g]) for g in range(2112) if speed[g] > 1.15]
    assert np.mean(fast) > np.mean(slow)


def test_dyn_negative_control():
    """Answers not offset by the counter's index (every counter handing out NS + 8 j) take some
    units twice and leave others out."""
    taken, NS = dyn_units(14336, 2112, 0, offset=lambda gw, j: 10560 + 8 * j)   # (NS = 5 rounds)
    assert NS == 10560
    units = sorted(u for us in taken.values() for u in us)
    assert units != list(range(14336))


def ogrp_units(NKV: int, H: int, NW: int, seed: int, RO: int = 4, last=None, counters: int = 8):
    """MLXP_MEGA_OGRP's o_proj mirrored from mega_ogrp.py: warps ask counter gw % 8 (answer j is
    unit gw % 8 + 8 j), unit u is (group u // NB, rows (u % NB) * RO ...), units finish in a random
    order; each adds 1 to its row block's counter and the unit that reads NKV - 1 (`last`) adds
    the NKV partials in group order. Returns {row block: groups it summed}, and the units taken."""
    rng = np.random.default_rng(seed)
    NB = H // RO
    NU = NKV * NB
    ctr = [0] * counters
    taken = []
    for gw in rng.permutation(NW):            # the warps ask in some order, each until it runs out
        while True:
            u = gw % counters + counters * ctr[gw % counters]
            ctr[gw % counters] += 1
            if u >= NU:
                break
            taken.append(u)
    last = last or (lambda old: old == NKV - 1)
    rcnt, parts, summed = [0] * NB, {}, {}
    for u in rng.permutation(taken):
        g, blk = divmod(int(u), NB)
        parts[(g, blk)] = True
        old, rcnt[blk] = rcnt[blk], rcnt[blk] + 1
        if last(old):
            assert all((gg, blk) in parts for gg in range(NKV)), f"block {blk} summed before group"
            summed[blk] = list(range(NKV))
    return summed, taken


@pytest.mark.parametrize("NKV,H,NW", [(8, 4096, 2112), (8, 2048, 2112), (1, 64, 16), (4, 256, 100)])
def test_ogrp_covers_every_unit_once_and_sums_every_row_block(NKV, H, NW):
    for seed in range(2):
        summed, taken = ogrp_units(NKV, H, NW, seed)
        assert sorted(taken) == list(range(NKV * H // 4))
        assert sorted(summed) == list(range(H // 4))
        assert all(v == list(range(NKV)) for v in summed.values())


def test_ogrp_negative_control():
    """A completing test off by one (old == NKV) never adds a block's partials."""
    summed, _ = ogrp_units(8, 256, 64, 0, last=lambda old: old == 8)
    assert not summed
