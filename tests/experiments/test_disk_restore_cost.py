"""experiments/disk_restore_cost.py at toy sizes: a session's chain of files restored whole,
bit-equal to what was stored, every part timed; the check can fail (a restore that returns
other K/V is reported as not bit-equal)."""

import json

from experiments import disk_restore_cost as drc

ARGS = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "300",
        "--turns", "2", "--turn-tokens", "70", "--trials", "2"]


def test_a_chain_is_restored_bit_equal_and_timed(tmp_path):
    row = drc.main(ARGS + ["--out", str(tmp_path)])
    assert row["bit_equal"] is True and row["files"] == 3 and row["tokens"] == 440
    assert row["restore_s"] > 0 and len(row["restore_trials_s"]) == 2 and row["bytes"] > 0
    assert json.loads((tmp_path / "run.json").read_text())["result"]["bit_equal"] is True


def test_other_k_v_are_caught(tmp_path, monkeypatch):
    real = drc.layer_kv
    calls = []

    def shifted(i, *a):      # the stored K/V as made; the reference for the check one off
        calls.append(i)
        return real(i + (1 if len(calls) > 2 else 0), *a)
    monkeypatch.setattr(drc, "layer_kv", shifted)
    assert drc.main(ARGS + ["--out", str(tmp_path)])["bit_equal"] is False
