"""experiments/mega_blocks.py's statistics on made-up arrivals (the GPU run is a device job)."""

import random

import pytest

from experiments.mega_blocks import analyse, pearson


def _steps(systematic: bool, n_steps=4, L=8, nb=16, seed=0):
    rng = random.Random(seed)
    speed = [1.0 + (0.3 if b % 5 == 0 else 0.0) for b in range(nb)]     # blocks 0, 5, 10, 15 slow
    out = []
    for _ in range(n_steps):
        if systematic:
            rows = [[10 * speed[b] + rng.uniform(0, 0.1) for b in range(nb)] for _ in range(L)]
        else:       # the same spread, but a different slow set in every layer
            rows = [[10 * speed[(b + rng.randrange(nb)) % nb] + rng.uniform(0, 0.1) for b in range(nb)] for _ in range(L)]
        out.append({"gate_up": rows})
    return out


def test_pearson():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0


def test_systematic_blocks_found():
    r = analyse(_steps(True))["gate_up"]
    assert r["layer_corr"] > 0.9 and r["step_corr"] > 0.9
    assert sorted(r["slowest"][:4]) == [0, 5, 10, 15]
    # one set of blocks always last: the phase waits for their sum; a rebalanced split is shorter
    assert r["slowest_us"] == pytest.approx(r["phase_us"], rel=0.02)
    assert r["harmonic_us"] < r["mean_us"] < r["phase_us"]
    assert len(r["per_block_us"]) == 16


def test_random_slow_blocks_negative_control():
    r = analyse(_steps(False))["gate_up"]
    assert abs(r["layer_corr"]) < 0.6 and abs(r["step_corr"]) < 0.6
    # a different block last in each layer: no block's sum comes near the sum of the maxima
    assert r["slowest_us"] < 0.9 * r["phase_us"]
