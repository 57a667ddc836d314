"""engine.adapters.lora: mlx-lm's LoRA init, adapter files both ways, runtime mount/unmount/stack.

Oracle comparisons (`parity`) are bit for bit (`mx.array_equal`).
"""

import json

import mlx.core as mx
import pytest
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model as ref_load_model

import engine
from engine.loader import load_model
from engine.adapters.lora import (AdapterError, LoRALinear, adapter_config, apply_lora, lora_layers,
                         lora_targets, save_adapter)
from engine.adapters.mount import mount_adapter, mounted_adapters, set_adapter, unmount_adapter
from parity.fixtures.models import ensure_fixture
from tests.train.helpers import FAMILIES, LORA, flat, inject_b, not_equal

PROMPT = mx.array([[5, 17, 300, 42, 9, 801, 77, 3, 128, 64, 11, 12]])


def _pair(family, dtype="float32", seed=7, num_layers=-1):
    p = ensure_fixture(family, dtype)
    ref = ref_load_model(p)[0]
    ours = load_model(p)[0]
    ref.freeze()
    mx.random.seed(seed)
    linear_to_lora_layers(ref, num_layers, dict(LORA))
    mx.random.seed(seed)
    apply_lora(ours, num_layers=num_layers, **LORA)
    return p, ref, ours


@pytest.mark.parity
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_layers", [-1, 1])
def test_init_equals_mlx_lm(family, num_layers):
    """Same seed -> the same targets, names, shapes, A (bitwise) and B = 0."""
    _, ref, ours = _pair(family, num_layers=num_layers)
    r, o = flat(ref.trainable_parameters()), flat(ours.trainable_parameters())
    assert sorted(r) == sorted(o)
    assert not not_equal(r, o)
    assert all(mx.all(v == 0).item() for k, v in o.items() if k.endswith("lora_b"))


@pytest.mark.parity
def test_prng_left_where_mlx_lm_leaves_it():
    p = ensure_fixture("llama")
    ref, ours = ref_load_model(p)[0], load_model(p)[0]
    mx.random.seed(3)
    linear_to_lora_layers(ref, -1, dict(LORA))
    a = mx.random.uniform(shape=(8,))
    mx.random.seed(3)
    apply_lora(ours, **LORA)
    b = mx.random.uniform(shape=(8,))
    assert mx.array_equal(a, b).item()


def test_targets_cover_gemma4_per_layer_projections():
    ours = load_model(ensure_fixture("gemma4_text"))[0]
    t = lora_targets(ours, -1)
    assert "model.layers.0.per_layer_input_gate" in t
    assert "model.layers.0.per_layer_projection" in t
    assert "model.layers.5.self_attn.k_proj" not in t  # KV-shared layer: no k_proj
    with pytest.raises(ValueError, match="only has 6 layers"):
        lora_targets(ours, 16)


@pytest.mark.parity
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q4"])
def test_our_adapter_loads_in_mlx_lm(family, dtype, tmp_path):
    """Adapter written by us -> mlx_lm.load(adapter_path=...) and engine.load give
    the logits of our in-memory LoRA model, bit for bit."""
    p, ref, ours = _pair(family, dtype)
    inject_b(ours, seed=1)
    ours.eval()
    expected = ours(PROMPT)
    save_adapter(ours, tmp_path, adapter_config(LORA["rank"], LORA["scale"], 0.0, -1))
    import mlx_lm
    ref_model, _ = mlx_lm.load(str(p), adapter_path=str(tmp_path))
    got_ref = ref_model(PROMPT)
    mounted, _tok = engine.load(p, adapter_path=tmp_path)
    got_ours = mounted(PROMPT)
    assert mx.array_equal(got_ref, expected).item()
    assert mx.array_equal(got_ours, expected).item()
    base = load_model(p)[0](PROMPT)
    assert not mx.array_equal(base, expected).item()  # the adapter does something


def _adapter_dir(tmp_path, family, seed, name, dtype="float32"):
    p = ensure_fixture(family, dtype)
    m = load_model(p)[0]
    mx.random.seed(seed)
    apply_lora(m, **LORA)
    inject_b(m, seed=seed)
    d = tmp_path / name
    save_adapter(m, d, adapter_config(LORA["rank"], LORA["scale"], 0.0, -1))
    return p, d


@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_scale_zero_and_inactive_give_base_bitwise(family, tmp_path):
    p, d = _adapter_dir(tmp_path, family, 2, "a")
    base = load_model(p)[0](PROMPT)
    m = load_model(p)[0]
    name = mount_adapter(m, d)
    assert not mx.array_equal(m(PROMPT), base).item()
    set_adapter(m, name, scale=0.0)
    assert mx.array_equal(m(PROMPT), base).item()
    set_adapter(m, name, scale=LORA["scale"], active=False)
    assert mx.array_equal(m(PROMPT), base).item()
    set_adapter(m, name, active=True)
    assert not mx.array_equal(m(PROMPT), base).item()
    unmount_adapter(m, name)
    assert not lora_layers(m)  # the module tree is the base's again
    assert mx.array_equal(m(PROMPT), base).item()


def test_stack_mount_unmount(tmp_path):
    p, da = _adapter_dir(tmp_path, "qwen3", 3, "a")
    _, db = _adapter_dir(tmp_path, "qwen3", 4, "b")
    ma, mb, mab = (load_model(p)[0] for _ in range(3))
    mount_adapter(ma, da)
    mount_adapter(mb, db)
    mount_adapter(mab, da)
    mount_adapter(mab, db)
    assert sorted(mounted_adapters(mab)) == ["a", "b"]
    base = load_model(p)[0]
    # stacked = base + delta_a + delta_b, applied in mount order
    both = mab(PROMPT)
    assert not mx.array_equal(both, ma(PROMPT)).item()
    set_adapter(mab, "b", active=False)
    assert mx.array_equal(mab(PROMPT), ma(PROMPT)).item()
    set_adapter(mab, "b", active=True)
    unmount_adapter(mab, "a")  # b is promoted to the primary slot: same as b alone
    assert mx.array_equal(mab(PROMPT), mb(PROMPT)).item()
    unmount_adapter(mab, "b")
    assert mx.array_equal(mab(PROMPT), base(PROMPT)).item()
    # the base weights were never touched
    assert not not_equal(flat(mab.parameters()), flat(base.parameters()))


def test_mount_keeps_nothing_trainable_and_base_frozen(tmp_path):
    p, d = _adapter_dir(tmp_path, "llama", 5, "a")
    m = load_model(p)[0]
    m.freeze()
    mount_adapter(m, d)
    assert not flat(m.trainable_parameters())
    with pytest.raises(AdapterError, match="already mounted"):
        mount_adapter(m, d)


def test_qlora_wraps_quantized_linear():
    m = load_model(ensure_fixture("llama", "q4"))[0]
    apply_lora(m, **LORA)
    q = dict(lora_layers(m))["model.layers.0.self_attn.q_proj"]
    assert type(q.linear).__name__ == "QuantizedLinear"
    assert q.lora_a.shape == (64, LORA["rank"]) and q.lora_a.dtype == mx.float32
    names = set(flat(m.trainable_parameters()))
    assert names and all(n.endswith(("lora_a", "lora_b")) for n in names)


def test_bad_adapter_dirs(tmp_path):
    p, d = _adapter_dir(tmp_path, "llama", 6, "good")
    m = load_model(p)[0]
    with pytest.raises(AdapterError, match="does not exist"):
        mount_adapter(m, tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="invalid JSON"):
        mount_adapter(m, bad)
    (bad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora",
                                                          "lora_parameters": {"rank": 4, "scale": 1}}))
    (bad / "adapters.safetensors").write_bytes((d / "adapters.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="dora"):
        mount_adapter(m, bad)
    # an adapter for another architecture (shapes / names do not fit)
    _, other = _adapter_dir(tmp_path, "gemma4_text", 6, "other")
    with pytest.raises(AdapterError):
        mount_adapter(m, other)
    assert not lora_layers(m)  # nothing half-applied


def test_lora_linear_rejects_non_linear():
    import mlx.nn as nn
    with pytest.raises(TypeError):
        LoRALinear(nn.RMSNorm(4))
