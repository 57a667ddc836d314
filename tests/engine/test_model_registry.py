"""The model registry and the config/checkpoint errors of the newer families."""

import json

import mlx.core as mx
import pytest

from engine.loader import ModelLoadError, load_model
from engine.models import build, supported
from parity.fixtures.models import FAMILIES, ensure_fixture


def test_every_fixture_model_type_is_registered():
    types = {FAMILIES[f]["model_type"] for f in FAMILIES}
    assert types <= set(supported())
    assert {"qwen2", "qwen3_moe", "gemma3_text", "gemma3", "gemma4_unified"} <= types


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported model_type 'nope'.*qwen3_moe"):
        build({"model_type": "nope"})


def test_gemma4_moe_config_without_expert_sizes_is_refused():
    cfg = dict(FAMILIES["gemma4_moe"]["text_config"], vocab_size=1024)
    del cfg["num_experts"]
    with pytest.raises(ValueError, match="enable_moe_block needs num_experts"):
        build(cfg)


def test_unified_checkpoint_drops_its_vision_weights():
    path = ensure_fixture("gemma4_unified")
    names = mx.load(str(path / "model.safetensors"))
    assert any(".vision_embedder." in k for k in names)
    model, config = load_model(path)
    assert config["model_type"] == "gemma4_unified" == model.model_type


def test_gemma3_checkpoint_without_language_model_is_a_load_error(tmp_path):
    src = ensure_fixture("gemma3")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"vision_tower.w": mx.zeros((2, 2))})
    with pytest.raises(ModelLoadError, match="no language_model"):
        load_model(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma3"
