"""The L3 gate on the CPU fixtures, and its negative control.

On the CPU the fast path runs the stock-MLX reference of every kernel, compiled:
it is measured bit-exact with L1 there (KL 0, top-1 1.0). Each deliberately broken
kernel (attention dropping the newest key, RoPE one position off) must fail the
same gate, or the gate would prove nothing."""

import pytest

from engine.fast import kernels
from engine.levers import resolve
from parity.fixtures.models import ensure_fixture
from parity.l3_gate import MAX_MEAN_KL, MIN_TOP1, run_gate


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def results(request):
    return {r.variant: r for r in run_gate(ensure_fixture(request.param, "bfloat16"), resolve("l3"),
                                           steps=32)}


def test_l3_passes_the_gate(results):
    r = results["l3"]
    assert r.kl_mean <= MAX_MEAN_KL and r.top1 >= MIN_TOP1 and r.passes
    assert r.tokens == 99


@pytest.mark.parametrize("fault", kernels.FAULTS)
def test_negative_control_fails_the_gate(results, fault):
    r = results[f"fault:{fault}"]
    assert not r.passes, r
    assert not r.bit_exact


def test_cpu_fast_path_is_bit_exact_with_l1(results):
    # a finding, not a tolerance: on the CPU every L3 lever computes L1's exact logits
    assert results["l3"].bit_exact and results["l3"].kl_max == 0.0


def test_fault_names_are_checked():
    with pytest.raises(ValueError):
        with kernels.inject_fault("nope"):
            pass


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def batch_results(request):
    from parity.l3_gate import run_batch_gate
    return {r.variant: r for r in run_batch_gate(ensure_fixture(request.param, "bfloat16"), 4, steps=16)}


def test_batch_fast_step_passes_the_gate_bit_exact_on_the_cpu(batch_results):
    """Four rows of different prompt lengths joining the fast runner at staggered steps and
    leaving after different numbers of tokens: against each row alone on L1, teacher-forced,
    every row and step."""
    r = batch_results["batch4:l3"]
    assert r.passes and r.bit_exact and r.kl_max == 0.0
    assert r.tokens == sum(16 - 4 * (b % 4) + 1 for b in range(4))      # (17 + 13 + 9 + 5)


@pytest.mark.parametrize("fault", kernels.FAULTS)
def test_batch_negative_control_fails_the_gate(batch_results, fault):
    r = batch_results[f"batch4:fault:{fault}"]
    assert not r.passes and not r.bit_exact, r


def test_verdict_is_invalid_when_a_fault_passes():
    """A gate whose negative control passes proves nothing: its verdict says so (seen on
    a model trained too briefly, whose continuations were all the same token)."""
    from parity.l3_gate import GateResult, verdict

    def row(variant, passes):
        return GateResult(model="m", variant=variant, kl_mean=0.0, kl_p99=0.0, kl_max=0.0, top1=1.0,
                          tokens=1, bit_exact=False, passes=passes)
    good = [row("l3", True), row("fault:rope_pos_plus_one", False), row("floor:float32", True)]
    assert verdict(good) == "pass"
    assert verdict([row("l3", False)] + good[1:]) == "fail"
    assert verdict(good + [row("batch8:fault:attn_drop_last_key", True)]) == "invalid"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def verify_results(request):
    from parity.l3_gate import run_verify_gate
    return {r.variant: r for r in run_verify_gate(ensure_fixture(request.param, "bfloat16"), 4, 3,
                                                  steps=16)}


def test_verify_steps_pass_the_gate_bit_exact_on_the_cpu(verify_results):
    """Four speculating rows through the fast runner's verify steps (1..4 positions a row a
    step, some taken back and fed again, rows leaving as they end): every kept position against
    each row alone on L1, teacher-forced."""
    r = verify_results["verify4k3:l3"]
    assert r.passes and r.bit_exact and r.kl_max == 0.0
    assert r.tokens == sum(16 - 4 * (b % 4) + 1 for b in range(4))


@pytest.mark.parametrize("fault", kernels.FAULTS)
def test_verify_negative_control_fails_the_gate(verify_results, fault):
    r = verify_results[f"verify4k3:fault:{fault}"]
    assert not r.passes and not r.bit_exact, r
