"""engine.fast.qmm on the CPU: the fragment mapping of the 4-bit tensor-core kernel (its lanes'
arithmetic in numpy, against MLX's own dequantized weights), which modules take it, its
argument checks, and the fast step choosing the step of separate kernels for 4-bit models
(where the GPU runs the kernel; on the CPU the same step is the model's own operations)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.fast import gemv as G
from engine.fast import qmm as Q


def _quantized(N, K, group_size=64, bits=4, seed=0):
    mx.random.seed(seed)
    lin = nn.QuantizedLinear(K, N, bias=False, group_size=group_size, bits=bits)
    lin.update({"scales": lin.scales.astype(mx.bfloat16), "biases": lin.biases.astype(mx.bfloat16)})
    return lin


def _arrays(lin):
    w = np.array(lin.weight).astype(np.uint32)
    s = np.array(lin.scales.astype(mx.float32)).astype(np.float64)
    b = np.array(lin.biases.astype(mx.float32)).astype(np.float64)
    return w, s, b


def _dequantized(lin, group_size):
    """MLX's dequantized weights, in float32 (scales and biases made float32 first)."""
    return np.array(mx.dequantize(lin.weight, lin.scales.astype(mx.float32), lin.biases.astype(mx.float32),
                                  group_size, 4), dtype=np.float64)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_mirror_matches_dequantized_product(group_size, rows):
    lin = _quantized(16, 256, group_size)
    w, s, b = _arrays(lin)
    x = np.random.default_rng(rows).standard_normal((rows, 256))
    wf = _dequantized(lin, group_size)
    got = Q.mirror(w, s, b, x, group_size)
    want = x @ wf.T
    # float64 sums in another order (weights MLX dequantizes in float32): equal to ~1e-7;
    # a wrong mapping is off by O(1)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


def test_mirror_sees_a_wrong_mapping():
    """Negative control: inputs in another order than the weights' (the permutation the
    kernel applies to both, applied to x alone) give another product."""
    lin = _quantized(16, 128)
    w, s, b = _arrays(lin)
    x = np.random.default_rng(0).standard_normal((4, 128))
    wf = _dequantized(lin, 64)
    perm = np.arange(128).reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    got = Q.mirror(w, s, b, x[:, perm], 64)
    assert np.abs(got - x @ wf.T).max() > 1e-3


def test_supports():
    assert Q.supports(_quantized(32, 256))
    assert Q.supports(_quantized(32, 256, group_size=32))
    assert not Q.supports(_quantized(32, 256, bits=8))
    assert not Q.supports(_quantized(32, 192))                  # K not a multiple of 128
    assert not Q.supports(_quantized(24, 256))                  # N not a multiple of 16
    f32 = nn.QuantizedLinear(256, 32, bias=False, group_size=64, bits=4)   # float32 scales
    assert not Q.supports(f32)
    biased = nn.QuantizedLinear(256, 32, bias=True, group_size=64, bits=4)
    biased.update({"scales": biased.scales.astype(mx.bfloat16), "biases": biased.biases.astype(mx.bfloat16)})
    assert not Q.supports(biased)
    assert not Q.supports(nn.Linear(256, 32, bias=False))
    assert G.supports(_quantized(32, 256)) and G.supports(nn.Linear(256, 32, bias=False))


def test_linear_checks_its_arguments():
    lin = _quantized(32, 256)
    with pytest.raises(ValueError, match="features"):
        Q.linear(lin, mx.zeros((1, 128), mx.bfloat16))
    with pytest.raises(ValueError, match="at most 32 rows"):
        Q.linear(lin, mx.zeros((33, 256), mx.bfloat16))
    with pytest.raises(ValueError, match="silu_split"):
        Q.linear(lin, mx.zeros((1, 256), mx.bfloat16), silu_split=8)


def test_config():
    cfg = Q.QmmConfig(warps=8, unroll=2, min_warps=4096)
    assert cfg.ksplit(256, 32) == 8          # 8B o_proj: 256 tiles, 32 chunks
    assert cfg.ksplit(8016, 32) == 1         # 8B head: enough tiles
    assert cfg.ksplit(256, 4) == 2           # each warp keeps two chunks
    assert cfg.ksplit(256, 2) == 1           # too few chunks to split
    with pytest.raises(ValueError):
        Q.QmmConfig(warps=3)


def test_gemv_linear_on_the_cpu_is_the_module():
    """Off the GPU the 4-bit path is the model's own operations, bit for bit."""
    lin = _quantized(32, 256)
    x = mx.random.normal((3, 1, 256)).astype(mx.bfloat16)
    h = mx.random.normal((3, 1, 32)).astype(mx.bfloat16)
    nw = mx.ones((256,), mx.bfloat16)
    got = G.linear(lin, x, norm=(nw, 1e-5), residual=h, use_kernel=False)
    want = h + lin(mx.fast.rms_norm(x, nw, 1e-5))
    assert mx.array_equal(got, want)


def test_fast_runner_takes_the_separate_kernels_for_4bit_rows():
    """A 4-bit model's rows past the one kernel go through gemv_stack (engine.fast.qmm on a
    GPU); on the CPU that step is the model's own operations: every row's tokens, logprobs
    and KV equal our L1 rows'. With the qmm kernel switched off it keeps the model's stack."""
    import random

    from engine.fast.decode import FastStep
    from engine.levers import parse_spec, resolve
    from engine.models import build
    from starter.models import FAMILIES
    from test_fast_runner import _lockstep, _prompt

    # the llama fixture's shape made wide enough for the kernel (K a multiple of 128)
    cfg = {**FAMILIES["llama"], "rms_norm_eps": 1e-6, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 1024}
    mx.random.seed(3)
    model = build(cfg)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    fast = parse_spec("l3")
    step = FastStep(model, fast)
    rng = random.Random(7)
    plan = {0: [(_prompt(rng, 12), 8), (_prompt(rng, 30), 10)], 2: [(_prompt(rng, 5), 6)]}
    seen, _ = _lockstep(model, step, plan, 30)
    assert seen >= 20 and step.stats.gemv
    off = FastStep(model, resolve("l3", env={"MLXP_DISABLE_KERNELS": "qmm"}))
    _lockstep(model, off, plan, 30)
    assert not off.stats.gemv


def test_4bit_rows_on_the_one_kernel_by_layer_size(monkeypatch):
    """On a GPU a 4-bit model's rows past the first never take the one kernel (its multi-row 4-bit
    calls were ~3x slower than qmm's), and its one row takes it only while a layer's weights are
    small (launch-bound separate step: 1B); large layers (8B) take qmm at one row too. No CUDA
    here: the one kernel is made available as on a GPU, and the choice and the buckets checked."""
    from engine.fast import decode as D
    from engine.fast import mega as MG
    from engine.fast.merge import merge_projections
    from engine.levers import parse_spec, resolve
    from engine.models import build
    from starter.models import FAMILIES

    cfg = {**FAMILIES["llama"], "rms_norm_eps": 1e-6, "hidden_size": 128, "intermediate_size": 256,
           "vocab_size": 1024}
    model = build(cfg)
    model.set_dtype(mx.bfloat16)
    monkeypatch.setattr(MG, "why_not", lambda model, levers: None)
    monkeypatch.setattr(MG, "rows_per_call", lambda model: 7)
    lv = parse_spec("l3")
    assert D.one_kernel_rows(model, lv) == (7, None)                     # (float)
    nn.quantize(model, group_size=64, bits=4)
    merge_projections(model)
    assert D.one_kernel_rows(model, lv) == (1, None)                     # (small layers)
    # without qmm (MLXP_DISABLE_KERNELS=qmm) its rows take the one kernel as float ones do
    assert D.one_kernel_rows(model, resolve("l3", env={"MLXP_DISABLE_KERNELS": "qmm"})) == (7, None)
    monkeypatch.setattr(D, "QMM_ONE_ROW_LAYER_BYTES", D.layer_bytes(model) - 1)
    rows, why = D.one_kernel_rows(model, lv)
    assert rows == 0 and why.startswith("4-bit layers this large")
    step = D.FastStep(model, lv)
    step.mega_rows, step.mega_off = rows, why             # (what a GPU sets: no CUDA here)
    step._mega_freq = mx.ones((model.layers[0].self_attn.head_dim // 2,))
    assert step._fn(1, 512)[1] is False and step.stats.mega_reason == why
    assert [step.rows_for(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_diag_mirror_matches_dequantized_dot(group_size):
    """The one kernel's 4-bit dot on the tensor cores (each lane's own weights and inputs on
    the diagonal of the mma's product): two weight rows against one input row."""
    lin = _quantized(2, 2048, group_size, seed=group_size)
    w, s, b = _arrays(lin)
    x = np.random.default_rng(group_size).standard_normal(2048)
    want = _dequantized(lin, group_size) @ x
    got = Q.diag_mirror(w, s, b, x, group_size)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


def test_diag_mirror_sees_a_wrong_lane():
    """Negative control: the sums read from lane (g, g % 4) instead of (g, g / 2) (an entry off
    the diagonal for most g), or inputs paired in plain order, give another dot."""
    lin = _quantized(2, 1024, 64)
    w, s, b = _arrays(lin)
    x = np.random.default_rng(1).standard_normal(1024)
    want = _dequantized(lin, 64) @ x
    assert np.abs(Q.diag_mirror(w, s, b, x, 64, diag_lane=lambda g: g % 4) - want).max() > 1e-2
    perm = np.arange(1024).reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    assert np.abs(Q.diag_mirror(w, s, b, x[perm], 64) - want).max() > 1e-2
