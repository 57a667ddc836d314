"""experiments/mega_sweep.py (the one-kernel step's switches A/B; the sweep itself runs on a
GPU) and experiments/batch_profile.py (where an Engine batch step spends its time)."""

import json

import pytest

from experiments import batch_profile, mega_sweep


def test_variant_specs():
    assert mega_sweep.parse_variant("20") == {"MLXP_MEGA_OPT": "20"}
    assert mega_sweep.parse_variant("596") == {"MLXP_MEGA_OPT": "596"}
    with pytest.raises(ValueError, match="unknown setting"):
        mega_sweep.parse_variant("4:threads=256")
    with pytest.raises(ValueError, match="unknown setting"):     # (a variant taken out)
        mega_sweep.parse_variant("596:pre=1")
    with pytest.raises(ValueError):
        mega_sweep.parse_variant("fast")


def test_variant_without_the_kernel_is_an_error_row(tmp_path, capsys):
    """Off a GPU the kernel cannot run: each variant is reported as an error, not a crash."""
    from parity.fixtures.models import ensure_fixture
    out = tmp_path / "s.json"
    assert mega_sweep.main(["--model", str(ensure_fixture("llama", "bfloat16")), "--variants", "0,20",
                            "--prompts", "8", "--steps", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["0", "20"]
    assert all("did not run" in r["error"] for r in rows)


def test_report_tables_and_plots_the_phases(tmp_path):
    prof = {"qkv_rope": 10.0, "attention": 5.0, "o_proj": 4.0, "gate_up": 20.0, "down": 9.0,
            "head": 2.0, "total": 50.0}
    rows = [{"prompt": 128, "variant": v, "wall_ms": 1.0, "profile_us": dict(prof, total=50.0 - i),
             "vs_first": {"top1": 1.0}} for i, v in enumerate(("0", "20"))]
    rows[1]["profile_us"]["arrive"] = {ph: {"min": 1.0, "median": 2.0, "max": 3.0} for ph in mega_sweep.PHASES}
    rows.append({"prompt": 128, "variant": "4", "error": "RuntimeError: x"})
    src = tmp_path / "sweep_x.json"
    src.write_text(json.dumps({"device": "gpu", "rows": rows}))
    assert mega_sweep.main(["--from-json", str(src), "--report", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "sweep.md").read_text()
    assert "| sweep_x | 128 | 20 | 10.0 | 5.0 | 4.0 | 20.0 | 9.0 | 2.0 | 49.0 | 1.0 | 1.0 |" in md
    assert "| 4 |" not in md and (tmp_path / "r" / "sweep.png").stat().st_size > 0
    assert "| sweep_x | 128 | 20 | 1.0 / 2.0 / 3.0 |" in md.split("When the blocks")[1]


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


def test_a_variant_is_the_kernel_it_names(monkeypatch):
    """A variant runs with its own mask and the phase timer, whatever the environment holds
    (the settings reach the decoder in its levers, not through the environment)."""
    seen = {}

    class Probe:                 # stands for the decoder: records the settings it is given
        def __init__(self, model, levers):
            seen["fast"] = levers.fast
            raise RuntimeError("probe")
    monkeypatch.setattr(mega_sweep, "FastDecoder", Probe)
    monkeypatch.setenv("MLXP_MEGA_OPT", "20")
    monkeypatch.setenv("MLXP_MEGA_QUANT", "0")
    with pytest.raises(RuntimeError, match="probe"):
        mega_sweep.run_variant(None, [1], [2], mega_sweep.parse_variant("596"))
    assert seen["fast"].opt == 596 and seen["fast"].prof is True and seen["fast"].quant is None


def test_a_lost_gpu_context_stops_the_sweep(tmp_path, monkeypatch):
    """After an error that leaves the process's CUDA context unusable (a kernel that trapped),
    the sweep saves what it has and stops (exit 3) instead of recording every later variant as
    failing with the same error; other errors stay one error row each."""
    from parity.fixtures.models import ensure_fixture
    calls = []

    def fake(model, prompt, seq, env, warm=3):
        calls.append(env.get("MLXP_MEGA_OPT"))
        if env.get("MLXP_MEGA_OPT") == "20":
            raise RuntimeError("cudaGetLastError() failed: an illegal instruction was encountered")
        raise RuntimeError("the one-kernel step did not run: test")
    monkeypatch.setattr(mega_sweep, "run_variant", fake)
    out = tmp_path / "s.json"
    rc = mega_sweep.main(["--model", str(ensure_fixture("llama", "bfloat16")), "--variants",
                          "596,20,84", "--prompts", "8,16", "--steps", "2", "--out", str(out)])
    assert rc == 3
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["596", "20"] and calls == ["596", "20"]
    assert "illegal instruction" in rows[1]["error"]
