"""experiments/fast_verify_gpu.py on the CPU fixtures: the verify against single fast steps,
every position bit-equal and every key and value the verify wrote equal (the stock-MLX
stand-ins compute each call row as a single step does); the comparison can fail: a verify
whose call rows all sit at the row's first column is caught, in its logits and its keys."""

import engine
from engine.fast.decode import FastStep
from experiments.fast_verify_gpu import check
from parity.fixtures.models import ensure_fixture
from verify_controls import calls_at_one_column


def test_the_verify_matches_single_steps_on_the_cpu():
    m, _ = engine.load(str(ensure_fixture("llama", "float32")))
    for rows, k in ((1, 2), (3, 3)):
        r = check(m, "llama", rows, k, trials=1)
        assert r["bit_equal"] == r["positions"] == rows * (k + 1) and r["keys_equal"]
        assert r["first_key_diff"] is None and r["plain_ms"] > 0 and r["verify_ms"] > 0


def test_negative_control_a_verify_at_one_column_is_caught(monkeypatch):
    m, _ = engine.load(str(ensure_fixture("qwen3", "float32")))
    calls_at_one_column(monkeypatch)
    r = check(m, "qwen3", 1, 2, trials=1)
    assert r["bit_equal"] < r["positions"] and not r["keys_equal"]
    assert r["first_key_diff"].startswith("layer 0 k row 0")


def test_the_phase_times_are_reported_only_where_the_one_kernel_timed_them(monkeypatch):
    """On the CPU no one kernel: no phases; a step whose kernel has the phase timer
    (MLXP_MEGA_PROF=1) reports its phases, the per-block arrivals left out."""
    m, _ = engine.load(str(ensure_fixture("llama", "float32")))
    r = check(m, "llama", 1, 2, trials=1)
    assert r["plain_phases_us"] == r["verify_phases_us"] == ""
    monkeypatch.setattr(FastStep, "mega_profile",
                        lambda self: {"qkv_rope": 10.4, "total": 20.0, "arrive": {"x": 1}})
    r = check(m, "llama", 1, 2, trials=1)
    assert r["plain_phases_us"] == r["verify_phases_us"] == "qkv_rope=10 total=20"
