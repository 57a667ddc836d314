"""experiments/mega_sass.py's reading of SASS: a batch of L2 reads ends where one of their values
is used (or at a branch), so loads issued back to back count as one batch and loads each waited
for count one by one."""

from experiments.mega_sass import PRESETS, kernel_source, l2_batches


def _sass(*ins):
    return "\n".join(f"        /*{16 * i:04x}*/                   {s} ;   /* 0x0 */" for i, s in enumerate(ins))


def test_back_to_back_loads_are_one_batch():
    sass = _sass("LDG.E.128.STRONG.GPU R8, desc[UR4][R2.64]",
                 "LDG.E.128.STRONG.GPU R12, desc[UR4][R2.64+0x10]",
                 "LDG.E.STRONG.GPU R20, desc[UR4][R4.64]",
                 "IMAD R30, R1, R2, RZ",
                 "F2FP.BF16.F32.PACK_AB R3, RZ, R14",      # uses R14: the second load's value
                 "STS [R5], R3")
    assert l2_batches(sass) == [3]


def test_loads_each_waited_for_are_batches_of_one():
    """The pattern of the element-by-element loops: load, use, load, use."""
    sass = _sass("LDG.E.STRONG.GPU R3, desc[UR12][R10.64+0x80]",
                 "FMUL R14, R50, R3",
                 "STS [R7], R14",
                 "LDG.E.STRONG.GPU R52, desc[UR12][R10.64+0x880]",
                 "FFMA R93, R52, R52, R93",
                 "LDG.E.STRONG.GPU R4, desc[UR12][R10.64+0x1080]",
                 "BRA 0x100")
    assert l2_batches(sass) == [1, 1, 1]


def test_a_written_register_is_not_a_use_and_weight_loads_do_not_count():
    sass = _sass("LDG.E.STRONG.GPU R3, desc[UR12][R10.64]",
                 "MOV R3, RZ",                              # overwrites R3: not a use
                 "LDG.E.NA.128.CONSTANT R40, desc[UR6][R8.64]",   # a weight load, not an L2 read
                 "LDG.E.STRONG.GPU R6, desc[UR12][R10.64+0x4]",
                 "IADD3 R9, R6, 0x1, RZ")
    assert l2_batches(sass) == [2]


def test_the_source_is_built_for_every_preset():
    for p in PRESETS:
        src = kernel_source(p, {"RB": "8"})
        assert "constexpr int RB = 8;" in src and "k_mega(" in src


def test_report_writes_table_plot_and_results(tmp_path):
    from experiments.mega_sass import report
    results = [{"preset": p, "env": env, "registers": 128, "spill_bytes": 4, "l2_read_batches": n,
                "l2_reads": 2 * n, "batches_by_size": {1: n // 2, 4: n - n // 2}}
               for p in ("1b", "8b") for env, n in (({}, 52), ({"STG": "1"}, 30))]
    report(results, tmp_path)
    md = (tmp_path / "sass.md").read_text()
    assert "| 8b | STG=1 | 128 | 4 | 30 | 15 | 60 |" in md and "| 1b | default |" in md
    assert (tmp_path / "sass.png").stat().st_size > 0
    assert (tmp_path / "sass.json").exists()
