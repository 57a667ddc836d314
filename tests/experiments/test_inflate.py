"""experiments/inflate.py: a trained Llama's function in a larger, zero-padded Llama shape
(the big target of the speculation benchmarks). Not a parity test: the larger model rounds
differently (float32 here), so its logits are compared with a tolerance, and the negative
controls show what the tolerance would not hide."""

import json

import mlx.core as mx
import pytest

import engine
from experiments import inflate as IF
from experiments.presets import PRESETS
from parity.fixtures.models import ensure_fixture

BIG = dict(model_type="llama", hidden_size=160, num_hidden_layers=3, intermediate_size=224,
           num_attention_heads=2, num_key_value_heads=1, head_dim=96)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    PRESETS["inflate-test"] = BIG
    src = ensure_fixture("llama", "float32")           # (rope_scaling llama3, 2 layers)
    dst = IF.inflate(src, tmp_path_factory.mktemp("big") / "m", "inflate-test", "float32")
    yield src, dst
    PRESETS.pop("inflate-test")


def _logits(path, ids):
    m, _ = engine.load(str(path))
    return m(mx.array([ids]))[0]


IDS = [5, 17, 300, 42, 999, 7, 7, 123, 64, 500, 3, 88]


def test_the_inflated_model_has_the_bigger_shape_and_the_small_ones_logits(pair):
    src, dst = pair
    cfg = json.loads((dst / "config.json").read_text())
    assert {k: cfg[k] for k in BIG if k != "model_type"} == {k: v for k, v in BIG.items() if k != "model_type"}
    w = mx.load(str(dst / "model.safetensors"))
    assert w["model.layers.2.mlp.down_proj.weight"].shape == (160, 224)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (2 * 96, 160)
    a, b = _logits(src, IDS), _logits(dst, IDS)
    assert mx.abs(a - b).max().item() < 1e-3 * mx.abs(a).max().item()
    assert (mx.argmax(a, -1) == mx.argmax(b, -1)).all().item()


def test_negative_controls_rope_and_norm_corrections_matter(pair, tmp_path):
    src, dst = pair
    a = _logits(src, IDS)
    for key in ("rope_theta", "rms_norm_eps"):
        bad = tmp_path / key
        bad.mkdir()
        for f in dst.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((dst / "config.json").read_text())
        small = json.loads((src / "config.json").read_text())
        cfg[key] = small[key] if key == "rope_theta" else small[key] * 1e4   # (undo / break it)
        (bad / "config.json").write_text(json.dumps(cfg))
        b = _logits(bad, IDS)
        assert mx.abs(a - b).max().item() > 1e-2 * mx.abs(a).max().item(), key


def test_shapes_it_cannot_take_are_refused(tmp_path):
    src = ensure_fixture("llama", "float32")
    PRESETS["inflate-bad"] = dict(BIG, num_attention_heads=4)
    try:
        with pytest.raises(ValueError, match="num_attention_heads"):
            IF.inflate(src, tmp_path / "x", "inflate-bad", "float32")
    finally:
        PRESETS.pop("inflate-bad")


def test_spec_bench_serves_the_inflated_target_once_built(tmp_path, monkeypatch):
    """spec_bench / spec_rounds `--inflate SHAPE`: the trained target padded into SHAPE, built
    once in the work directory and reused; without it the target itself."""
    import shutil
    from experiments.spec_bench import inflated
    monkeypatch.setitem(PRESETS, "inflate-test", BIG)
    target = tmp_path / "1b"
    shutil.copytree(ensure_fixture("llama", "float32"), target)
    assert inflated(target, None, tmp_path) == target
    out = inflated(target, "inflate-test", tmp_path)
    assert out == tmp_path / "1b-in-inflate-test"
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 160
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert inflated(target, "inflate-test", tmp_path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
