"""experiments/verify_exactness_gpu.py on the CPU fixtures: every way of feeding a row's two
tokens (single steps, one verify, a two-row pool, two verifies) gives the same logits at both
positions (the stock-MLX stand-ins); the comparison can fail: a verify whose call rows all sit at
the row's first column (both tokens' keys written at one column) differs from the single steps,
the ways without a verify of several call rows do not."""

import random

import engine
from experiments.verify_exactness_gpu import compare, ways
from parity.fixtures.models import ensure_fixture
from verify_controls import calls_at_one_column


def _run(name):
    m, _ = engine.load(str(ensure_fixture(name, "float32")))
    rng = random.Random(0)
    return compare(ways(m, [rng.randrange(4, 900) for _ in range(11)], 17, 23))


def test_every_way_is_bit_equal_on_the_cpu():
    for name in ("llama", "qwen3"):
        res = _run(name)
        assert all(v["equal"] and v["max_abs_diff"] == 0.0 for v in res.values()), (name, res)


def test_negative_control_call_rows_at_one_column_are_caught(monkeypatch):
    calls_at_one_column(monkeypatch)
    res = _run("llama")
    assert not res["AB_pos1"]["equal"] and not res["BC_pos1"]["equal"]
    assert all(res[f"A{x}_pos{j}"]["equal"] for x in "CD" for j in (0, 1))
