"""Adapters on a model with merged projections (`--merged-proj`).

Mounting an adapter onto a projection of a merged q/k/v or gate/up group splits that
group back into separate modules (row slices of the merged matrix: the same values);
once no adapter is left on it, it merges again. Logits are compared bit for bit
(`mx.array_equal`) with the same adapters on a model that was never merged.
"""

import mlx.core as mx
import pytest

import engine
from engine.adapters.registry import AdapterRegistry
from engine.fast.merge import Part, merge_projections
from engine.levers import parse_spec
from engine.loader import load_model
from engine.adapters.lora import AdapterError, adapter_config, apply_lora
from engine.adapters.mount import mount_adapter, set_adapter, unmount_adapter
from parity.fixtures.models import ensure_fixture
from tests.train.helpers import inject_b

PROMPT = mx.array([[5, 17, 300, 42, 9, 801, 77, 3, 128, 64, 11, 12]])
QV_DOWN = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")   # splits q/k/v only
Q_UP = ("self_attn.q_proj", "mlp.up_proj")                           # splits both groups


def _adapter(tmp_path, family, dtype, seed, keys):
    from engine.adapters.lora import save_adapter
    m = load_model(ensure_fixture(family, dtype))[0]
    mx.random.seed(seed)
    apply_lora(m, rank=4, scale=2.0, num_layers=-1, keys=list(keys))
    inject_b(m, seed=seed, scale=0.5)
    d = tmp_path / f"{family}-{dtype}-{seed}"
    save_adapter(m, d, adapter_config(4, 2.0, 0.0, -1, keys=list(keys)))
    return d


def _merged(family, dtype):
    m = load_model(ensure_fixture(family, dtype))[0]
    assert merge_projections(m) > 0
    return m


def _groups(model, i=0):
    layer = model.layers[i]
    return (isinstance(layer.self_attn.q_proj, Part), isinstance(layer.mlp.gate_proj, Part))


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("qwen3", "bfloat16"),
                                           ("llama", "q4")])
def test_mount_stack_unmount_on_merged_equals_unmerged(family, dtype, tmp_path):
    a = _adapter(tmp_path, family, dtype, 1, QV_DOWN)
    b = _adapter(tmp_path, family, dtype, 2, Q_UP)
    plain = load_model(ensure_fixture(family, dtype))[0]
    merged = _merged(family, dtype)
    base = plain(PROMPT)
    assert mx.array_equal(merged(PROMPT), base).item()

    def same():
        return mx.array_equal(merged(PROMPT), plain(PROMPT)).item()

    for m in (plain, merged):
        mount_adapter(m, a, name="a")
    assert _groups(merged) == (False, True)          # q/k/v split, gate/up still merged
    assert same() and not mx.array_equal(merged(PROMPT), base).item()
    for m in (plain, merged):
        mount_adapter(m, b, name="b")
    assert _groups(merged) == (False, False) and same()
    for m in (plain, merged):
        set_adapter(m, "a", active=False)
    assert same()
    for m in (plain, merged):
        unmount_adapter(m, "a")
    assert _groups(merged) == (False, False) and same()   # b still holds q and up
    for m in (plain, merged):
        unmount_adapter(m, "b")
    assert _groups(merged) == (True, True)           # merged again once no adapter is left
    assert mx.array_equal(merged(PROMPT), base).item()


def test_a_refused_mount_leaves_the_groups_merged(tmp_path):
    a = _adapter(tmp_path, "qwen3", "float32", 1, QV_DOWN)     # qwen3 shapes, llama model
    m = _merged("llama", "float32")
    base = m(PROMPT)
    with pytest.raises(AdapterError):
        mount_adapter(m, a, name="a")
    assert _groups(m) == (True, True)
    assert mx.array_equal(m(PROMPT), base).item()


def _generate(model, tok, levers, registry, adapters, max_batch=1):
    eng = engine.Engine(model, tok, max_batch=max_batch, levers=levers, adapters=registry,
                        keep_logprob_arrays=True)
    eng.submit("def f(x):", engine.SamplingParams(max_tokens=8, temperature=0.0),
               adapter=adapters)
    lps = []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None, out.error
            lps += out.logprob_arrays
    return lps


@pytest.mark.parametrize("spec, max_batch", [("l1+merged_proj", 4), ("l3", 1)])
def test_engine_hot_mount_on_merged_equals_plain_l1(spec, max_batch, tmp_path):
    """A registry mount between requests on a merged model (batch lane, and the L3 fast
    step whose traced steps must not outlive the module change): every logprob vector
    equals plain L1 with the same adapter."""
    path = str(ensure_fixture("llama", "bfloat16"))
    a = _adapter(tmp_path, "llama", "bfloat16", 1, QV_DOWN)

    def run(levers, mb):
        model, tok = engine.load(path)
        reg = AdapterRegistry(model)
        out = [_generate(model, tok, levers, reg, (), mb)]
        reg.mount("A", str(a))
        out += [_generate(model, tok, levers, reg, ("A",), mb),
                _generate(model, tok, levers, reg, (), mb)]
        reg.unmount("A")
        out.append(_generate(model, tok, levers, reg, (), mb))
        return model, out

    _, want = run(None, 1)
    model, got = run(parse_spec(spec), max_batch)
    assert _groups(model) == (True, True)
    for w, g in zip(want, got):
        assert len(w) == len(g) == 8
        assert all(mx.array_equal(x, y).item() for x, y in zip(w, g))
    assert not all(mx.array_equal(x, y).item() for x, y in zip(want[0], want[1]))
