"""engine/fast/invariant.py on the CPU: what can be checked without CUDA.

The batch-invariant kernels themselves run only on CUDA (experiments/deterministic_gpu.py
checks them there, op by op and end to end). Here: the row blocks give the stock matmul's
bits (the CPU's matmuls are row-invariant already), the module swap keeps every parameter,
the row ranges the attention kernel reads are the mask's (its stock-MLX form equals MLX's
attention under the original mask, bit for bit), masks it cannot honour are refused, and
the Engine routes attention and refuses what has no invariant form.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import engine
from engine import Engine, SamplingParams, deterministic
from engine.fast import invariant
from engine.kv.masks import causal_mask
from engine.models import base
from starter.models import ensure_fixture


@pytest.fixture(autouse=True)
def _off():
    yield
    invariant.enable(False)


@pytest.mark.parametrize("rows", [1, 5, 64, 65, 200])
def test_row_blocks_give_the_stock_matmuls_bits(rows):
    mx.random.seed(rows)
    lin = nn.Linear(96, 80, bias=True)
    q = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), group_size=64, bits=4)
    for module, k in ((lin, 96), (q, 128)):
        x = mx.random.normal((2, rows, k))
        want = module(x)
        stock = type(module)
        invariant.apply(module)
        assert type(module) is not stock and isinstance(module, stock)
        got = module(x)
        assert got.shape == want.shape and mx.array_equal(got, want).item()
        module.__class__ = stock


def test_float_weights_take_every_block_in_one_gather_call(monkeypatch):
    """On CUDA a float weight's blocks go through one mx.gather_mm (no cuBLASLt lookup per
    call): a row gives the same bits alone and at any place among 5 / 64 / 65 / 200 rows (here
    float32 on the CPU, the dtype its gather_mm takes), the stock matmul's bits without a
    bias, and one gather call however many blocks."""
    monkeypatch.setattr(invariant, "on_cuda", lambda device=None: True)
    mx.random.seed(3)
    lin, bare, emb = nn.Linear(96, 80, bias=True), nn.Linear(96, 80, bias=False), nn.Embedding(50, 96)
    row = mx.random.normal((1, 96))
    for m in (lin, bare, emb):
        invariant.apply(m)
    calls = []
    real = mx.gather_mm
    monkeypatch.setattr(invariant.mx, "gather_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    for m, f in ((lin, lin), (bare, bare), (emb, emb.as_linear)):
        alone = f(row)
        for n, at in ((5, 3), (64, 63), (65, 64), (200, 130)):
            x = mx.random.normal((n, 96))
            x[at:at + 1] = row
            calls.clear()
            got = f(x.reshape(1, n, 96))
            assert len(calls) == 1 and got.shape[:2] == (1, n)
            assert mx.array_equal(got[0, at:at + 1], alone).item(), (type(m).__name__, n)
            if m is not lin:
                w = m.weight
                assert mx.array_equal(got[0], x @ w.T).item()


def test_the_swap_keeps_the_parameters_and_is_done_once():
    model, _ = engine.load(str(ensure_fixture("llama")))
    before = {k: v for k, v in tree_flatten(model.parameters())}
    x = mx.array([[5, 17, 99, 4]])
    want = model(x)
    n = invariant.apply(model)
    assert n > 0 and invariant.applied(model)
    assert invariant.apply(model) == 0
    after = {k: v for k, v in tree_flatten(model.parameters())}
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert mx.array_equal(model(x), want).item()


def _masks(B, T, L):
    lp = mx.array([0, 3, 7][:B])
    return {"none": None, "causal": "causal", "square": causal_mask(T, L - T),
            "left_padded": causal_mask(T, L - T, left_padding=lp)}


@pytest.mark.parametrize("name", ["none", "causal", "square", "left_padded"])
@pytest.mark.parametrize("T", [1, 6])
def test_the_kernels_row_ranges_are_the_masks(name, T):
    B, H, Hkv, L, D = 3, 4, 2, 20, 32
    mx.random.seed(T)
    q = mx.random.normal((B, H, T, D))
    k = mx.random.normal((B, Hkv, L, D))
    v = mx.random.normal((B, Hkv, L, D))
    mask = _masks(B, T, L)[name]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    got = invariant.attention(q, k, v, 0.2, mask, use_kernel=False)
    assert mx.array_equal(got, want).item()


def test_row_ranges():
    lo, hi, m = invariant._ranges(causal_mask(3, 4, left_padding=mx.array([0, 2])), 2, 3, 7)
    assert lo.tolist() == [0, 2] and hi.tolist() == [[5, 6, 7], [5, 6, 7]] and m.shape == (2, 3, 7)
    lo, hi, m = invariant._ranges("causal", 2, 3, 7)
    assert lo.tolist() == [0, 0] and hi.tolist() == [[5, 6, 7]] * 2 and m is None


def test_masks_it_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="additive"):
        invariant._ranges(mx.zeros((1, 1, 2, 4)), 1, 2, 4)
    with pytest.raises(ValueError, match="every head"):
        invariant._ranges(mx.ones((1, 2, 2, 4), mx.bool_), 1, 2, 4)
    with pytest.raises(ValueError, match="unknown attention mask"):
        invariant._ranges("sliding", 1, 2, 4)


def test_attention_goes_through_the_kernel_when_enabled(monkeypatch):
    seen = []
    monkeypatch.setattr(invariant, "attention", lambda *a, **k: seen.append(a) or "kernel")
    q = k = v = mx.zeros((1, 2, 3, 32))
    assert base.attention(q, k, v, None, 1.0, "causal") != "kernel"
    invariant.enable()
    assert base.attention(q, k, v, None, 1.0, "causal") == "kernel" and len(seen) == 1


def test_prepare_on_cuda_and_elsewhere():
    model, tok = engine.load(str(ensure_fixture("llama")))
    assert deterministic.prepare(model, device=mx.Device(mx.cpu)) is False
    assert not invariant.applied(model) and not invariant.enabled()
    gemma, _ = engine.load(str(ensure_fixture("gemma3_text")))
    with pytest.raises(deterministic.DeterministicUnsupported, match="full-attention dense"):
        deterministic.prepare(model, gemma, device=mx.Device(mx.gpu))
    assert not invariant.applied(model) and not invariant.enabled()
    assert deterministic.prepare(model, device=mx.Device(mx.gpu)) is True
    assert invariant.applied(model) and invariant.enabled()


def test_adapters_are_refused_where_the_kernels_run(monkeypatch):
    model, tok = engine.load(str(ensure_fixture("llama")))
    eng = Engine(model, tok, max_batch=2, deterministic=True, adapters=object())
    monkeypatch.setattr(deterministic, "refuses_adapters", lambda: True)
    with pytest.raises(ValueError, match="does not run adapters"):
        eng.submit([5, 6, 7], SamplingParams(max_tokens=1), adapter=("a",))
