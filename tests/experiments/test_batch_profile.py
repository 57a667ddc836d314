"""experiments/batch_profile.py (where an Engine batch step spends its time) and
experiments/step_overhead.py (what a decode step costs around its kernels)."""

import json

import pytest

from experiments import batch_profile


def test_batch_profile_quick(tmp_path):
    out = tmp_path / "p.json"
    assert batch_profile.main(["--quick", "--batches", "2", "--steps", "3", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["B"] == 2 and r["step_ms"] > 0 and r["synced_step_ms"] > 0
    assert r["levers"]["steps"] > 0 and any("_decode_step" in line for line in r["profile_top"])


def test_step_overhead_runs_off_a_gpu(tmp_path):
    """experiments/step_overhead.py on the CPU fixture: every mode timed, the kernel's timer
    reported as absent (-1, no one-kernel step here), the step's operations counted."""
    from experiments import step_overhead
    from parity.fixtures.models import ensure_fixture
    out = tmp_path / "o.json"
    assert step_overhead.main(["--model", str(ensure_fixture("llama", "bfloat16")), "--prompt", "8",
                               "--gen", "4", "--trials", "1", "--ops", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["ms_per_token"]) == set(step_overhead.MODES)
    assert all(v > 0 for v in r["ms_per_token"].values())
    assert r["kernel_ms"] == -1.0 and r["around_kernel_ms"] is None and not r["mega"]
    assert r["ops"].get("ArgReduce", 0) >= 1 or r["ops"].get("ArgMax", 0) >= 1, r["ops"]
    with pytest.raises(SystemExit):
        step_overhead.main(["--model", "x", "--gen", "1"])
    # the report: a table row per file and the stacked parts
    r.update(kernel_ms=0.9, around_kernel_ms=0.05, argmax_ms=0.01, logprobs_ms=0.02, host_ms=0.0)
    out.write_text(json.dumps(r))
    assert step_overhead.main(["--from-json", str(out), "--report", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "overhead.md").read_text()
    assert "around_kernel_ms" in md and "| llama" in md and (tmp_path / "rep" / "overhead.png").stat().st_size > 0
