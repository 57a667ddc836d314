"""MLXP_MEGA_BAL (engine.fast.mega_bal): the plan that shares each phase's last rounds of units
out by the blocks' measured speeds. The kernel's loop is mirrored in Python (`walk`): every
unit computed by exactly one warp, the dealt part unchanged, slow blocks given fewer units —
with negative controls (a plan whose links skip a unit; the default dealing under slow blocks)."""

import json
import re

import mlx.core as mx
import pytest

from engine.fast import mega as MG
from engine.fast import mega_bal as B
from engine.fast.merge import merge_projections
from engine.loader import load_model
from parity.fixtures.models import ensure_fixture

WPB = 16
SHAPES = {"8b": {"pairs": 3072, "hidden": 4096, "inter": 14336, "vocab": 128256},
          "1b": {"pairs": 1536, "hidden": 2048, "inter": 8192, "vocab": 128256}}


def _cal(blocks: int, slow=(), factor=1.25) -> dict:
    """A made-up mega_blocks result: blocks in `slow` take `factor` times as long a unit."""
    ph = {}
    for name, key in B.PHASE_SIZE.items():
        N = SHAPES["8b"][key]
        dealt = B.dealt_units(N, blocks * WPB, WPB, blocks)
        ph[name] = {"per_block_us": [d * (factor if b in slow else 1.0) for b, d in enumerate(dealt)]}
    return {"phases": ph}


def _units_by_warp(tab, N, NW):
    return [B.walk(tab, N, NW, gw) for gw in range(NW)]


@pytest.mark.parametrize("shape,blocks", [("8b", 132), ("8b", 128), ("1b", 132), ("1b", 114)])
def test_every_unit_once_and_the_dealt_part_unchanged(shape, blocks):
    sizes = SHAPES[shape]
    tab = B.plan_table(_cal(blocks, slow=range(0, blocks, 7)), sizes, blocks, WPB)
    NW = blocks * WPB
    for key, N in sizes.items():
        per = _units_by_warp(tab, N, NW)
        seen = sorted(u for units in per for u in units)
        assert seen == list(range(N)), (key, N)
        NS = B.static_units(N, NW)
        for gw, units in enumerate(per):          # the dealt units first, as the default deals them
            assert [u for u in units if u < NS] == list(range(gw, NS, NW))
            assert units == sorted(units)


def test_slow_blocks_get_fewer_units_and_the_phase_ends_sooner():
    blocks, N = 132, SHAPES["8b"]["inter"]
    slow = set(range(0, blocks, 4))
    tab = B.plan_table(_cal(blocks, slow=slow), SHAPES["8b"], blocks, WPB)
    NW = blocks * WPB
    per = _units_by_warp(tab, N, NW)
    count = [sum(len(per[b * WPB + w]) for w in range(WPB)) for b in range(blocks)]
    cost = [1.25 if b in slow else 1.0 for b in range(blocks)]
    dealt = B.dealt_units(N, NW, WPB, blocks)
    assert max(count[b] for b in slow) < min(count[b] for b in range(blocks) if b not in slow)
    bal_end = max(c * n for c, n in zip(cost, count))
    dealt_end = max(c * n for c, n in zip(cost, dealt))
    # the default dealing (negative control) waits for the slow blocks' full share
    assert bal_end < 0.93 * dealt_end
    # even speeds: the plan is as even as dealing (no block more than one unit a warp apart)
    tab = B.plan_table(_cal(blocks), SHAPES["8b"], blocks, WPB)
    per = _units_by_warp(tab, N, NW)
    lens = [len(u) for u in per]
    assert max(lens) - min(lens) <= 1


def test_a_broken_link_is_caught():
    blocks = 132
    tab = B.plan_table(_cal(blocks), SHAPES["8b"], blocks, WPB)
    off = tab[2 * 2 + 1]                          # inter's list
    N, NW = SHAPES["8b"]["inter"], blocks * WPB
    bad = list(tab)
    i = next(j for j in range(off, off + N) if bad[j] < N and bad[bad[j] - B.static_units(N, NW) + NW + off] < N)
    bad[i] = bad[bad[i] - B.static_units(N, NW) + NW + off]   # skip a unit
    seen = sorted(u for units in _units_by_warp(bad, N, NW) for u in units)
    assert seen != list(range(N))


def test_phases_of_one_size_share_a_plan():
    sizes = {"pairs": 4096, "hidden": 4096, "inter": 14336, "vocab": 128256}
    tab = B.plan_table(_cal(132), sizes, 132, WPB)
    assert tab[0] == tab[2] == 4096 and tab[1] == tab[3]
    per = _units_by_warp(tab, 4096, 132 * WPB)
    assert sorted(u for units in per for u in units) == list(range(4096))


def test_plan_table_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="132 blocks"):
        B.plan_table(_cal(128), SHAPES["8b"], 132, WPB)
    cal = _cal(132)
    del cal["phases"]["gate_up"]
    with pytest.raises(ValueError, match="gate_up"):
        B.plan_table(cal, SHAPES["8b"], 132, WPB)
    with pytest.raises(ValueError, match="cannot read"):
        B.load_table(str(tmp_path / "none.json"), SHAPES["8b"], 132, WPB)
    with pytest.raises(ValueError, match="MLXP_MEGA_BAL"):
        MG.check_settings({"MLXP_MEGA_BAL": str(tmp_path / "none.json")})


def test_the_kernel_source_mirrors_the_plan():
    assert f"constexpr int BAL_TAIL = {B.TAIL_ROUNDS};" in B.DYN
    assert "max(r - BAL_TAIL, 1) * NW" in B.DYN
    # the plan's header: four (N, offset) pairs, read by N
    assert re.search(r"for \(int j = 0; j < 4; \+\+j\) if \(__ldg\(tb \+ 2 \* j\) == N\)", B.DYN)
    for N, NW in ((14336, 2112), (3072, 2112), (1536, 2112), (128256, 2048), (2112, 2112)):
        r = N // NW
        assert B.static_units(N, NW) == min(N, max(r - B.TAIL_ROUNDS, 1) * NW)


def test_the_step_reads_the_plan(monkeypatch, tmp_path):
    llama = load_model(str(ensure_fixture("llama", "bfloat16")))[0]
    merge_projections(llama)
    a0 = llama.layers[0].self_attn
    monkeypatch.setattr(MG, "sm_count", lambda: 4)
    probe = MG.MegaStep(llama, mx.ones((a0.head_dim // 2,)))
    sizes = {"pairs": (probe.NQ + 2 * probe.NKV) * probe.D // 2, "hidden": probe.H, "inter": probe.I,
             "vocab": probe.V}
    ph = {name: {"per_block_us": [1.0 + b for b in range(4)]} for name in B.PHASE_SIZE}
    f = tmp_path / "blocks.json"
    f.write_text(json.dumps({"phases": ph}))
    monkeypatch.setenv("MLXP_MEGA_BAL", str(f))
    step = MG.MegaStep(llama, mx.ones((a0.head_dim // 2,)))
    assert step.dyn == 2 and step.prod == 0
    words = mx.view(step.bal, mx.int32).tolist()
    assert words == B.plan_table({"phases": ph}, sizes, 4, WPB)
    # with another compile-time choice the plan is not used
    monkeypatch.setenv("MLXP_MEGA_QROW", "1")
    assert MG.MegaStep(llama, mx.ones((a0.head_dim // 2,))).bal is None
