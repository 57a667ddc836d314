"""The one-kernel step's producer warp (MLXP_MEGA_PROD, engine.fast.mega_prod), mirrored: the
rows it asks L2 for, block by block, are exactly the rows the block's 15 other warps read (q/k/v
rotation pairs with FLOW's keys-and-values-first order, o_proj, gate/up pairs, down, the head),
its byte count equals the bytes the warps count (so its window neither drifts nor stalls), and
every row of every matrix is asked for by exactly one block. Negative controls: a producer
without FLOW's order, or dealing for 16 warps, asks for other rows. Plus the settings' checks and
the source's switches."""

import pytest

from engine.fast import mega as M
from engine.fast import mega_cuda as C
from engine.fast import mega_device as MD
from engine.fast import mega_prod as P

SHAPES = {"8b": dict(H=4096, NQ=32, NKV=8, D=128, I=14336, V=128256),
          "1b": dict(H=2048, NQ=32, NKV=8, D=64, I=8192, V=32000),
          "odd": dict(H=960, NQ=15, NKV=5, D=64, I=2560, V=1000)}


def phases(s, flow=True):
    """(matrix, units, rows a unit, row bytes / 2, row of (unit, k)) of one layer, then the head."""
    NQ, NKV, D, H, I, V = s["NQ"], s["NKV"], s["D"], s["H"], s["I"], s["V"]
    HALF, QD = D // 2, NQ * D
    NPAIR = (NQ + 2 * NKV) * HALF

    def qkv(u0, k):
        u = (u0 + NQ * HALF) % NPAIR if flow else u0
        return (u // HALF) * D + u % HALF + k * HALF
    return [("wqkv", NPAIR, 2, H, qkv), ("wo", H, 1, QD, lambda u, k: u),
            ("wgu", I, 2, H, lambda u, k: u + k * I), ("wd", H, 1, I, lambda u, k: u),
            ("head", V, 1, H, lambda u, k: u)]


def consumer(s, block, blocks, wpb=15, spread=False):
    """The rows warp w of `block` reads, phase by phase, and the bytes the warps count
    (MEGA_PCOUNT: each batch's loads, all of a unit's row bytes in the end)."""
    nw = blocks * wpb
    rows, nbytes = set(), 0
    for name, n, rl, k, rowf in phases(s):
        for w in range(wpb):
            gw = w * blocks + block if spread else block * wpb + w
            for u0 in range(gw, n, nw):
                for r in range(rl):
                    rows.add((name, rowf(u0, r)))
                    nbytes += 2 * k
    return rows, nbytes


def producer(s, block, blocks, wpb=15, spread=False, flow=True):
    """The producer warp's lanes, round by round (mega_prod.PRODUCER's `stream`): lane j takes
    row j // wpb of warp j % wpb's unit; each step asks for a line of every active lane's row
    and counts 128 bytes a lane."""
    nw = blocks * wpb
    rows, nbytes = set(), 0
    for name, n, rl, k, rowf in phases(s, flow):
        u_base = 0
        while True:
            act = []
            for lane in range(32):
                pw, pk = lane % wpb, lane // wpb
                pgw = pw * blocks + block if spread else block * wpb + pw
                u0 = pgw + u_base
                if pk < rl and u0 < n:
                    act.append(rowf(u0, pk))
            if not act:
                break
            rows.update((name, r) for r in act)
            nbytes += (2 * k // 128) * 128 * len(act)
            u_base += nw
    return rows, nbytes


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("blocks", [132, 114, 7])
@pytest.mark.parametrize("spread", [False, True])
def test_producer_asks_for_the_rows_the_block_reads(shape, blocks, spread):
    s = SHAPES[shape]
    seen = {}
    for b in range(blocks):
        want, want_bytes = consumer(s, b, blocks, spread=spread)
        got, got_bytes = producer(s, b, blocks, spread=spread)
        assert got == want
        assert got_bytes == want_bytes
        for r in got:
            assert r not in seen, (r, b, seen.get(r))
            seen[r] = b
    total = sum(n * rl for _, n, rl, _, _ in phases(s))
    assert len(seen) == total


def test_producer_negative_controls():
    s, blocks = SHAPES["8b"], 132
    # without FLOW's order (keys and values first) the rows of phase A differ
    assert producer(s, 0, blocks, flow=False)[0] != consumer(s, 0, blocks)[0]
    # dealt as if all 16 warps computed: other units
    assert producer(s, 3, blocks, wpb=16)[0] != consumer(s, 3, blocks)[0]


def test_row_bytes_are_whole_lines():
    # the producer steps 128 bytes at a time: every row of every preset is a whole number of lines
    for s in SHAPES.values():
        for _, _, _, k, _ in phases(s):
            assert (2 * k) % 128 == 0


def test_settings():
    M.check_settings({"MLXP_MEGA_PROD": "128"})
    M.check_settings({"MLXP_MEGA_PROD": "0"})
    for bad in ("-1", "x", "5000", "1.5"):
        with pytest.raises(ValueError, match="MLXP_MEGA_PROD"):
            M.check_settings({"MLXP_MEGA_PROD": bad})


def test_source_switches():
    src = C.source(2)
    # the producer only where MEGA_PRODUCER is defined (its kernels' header), after the tables
    assert "#ifdef MEGA_PRODUCER" in src and src.index("WQKV[2]") < src.index("if (warp == WPB)")
    assert MD.header(128).startswith("#define MEGA_PRODUCER 1\n") and "MEGA_PRODUCER 1" not in MD.header(0)
    # the block's barriers are the named barrier of the 15 computing warps with a producer
    assert "__syncthreads();" not in src.replace(P.PRODUCER, "")
    assert 'bar.sync 1, 480' in MD.HEADER and C.THREADS - 32 == 480
