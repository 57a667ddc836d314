"""An image row with adapters (issues #38 / #40 together): the request's adapters apply to
the whole request, the vision tower included, as when it runs alone. An adapter may target
the tower's projections (`engine.adapters.mount` takes any linear of the model), so the
image row's merged embeddings must be computed with its adapters on; the batch around it
runs with every runtime adapter off."""

import io
import json

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from engine import Engine, SamplingParams
from engine.adapters.registry import AdapterRegistry
from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from starter.vision import ensure_vision_fixture

MSG = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
TOWER = "vision_tower.vision_model.encoder.layers.{}.self_attn.q_proj"


def _png(seed) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 30, 3),
                                                         dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _tower_adapter(model, out) -> str:
    """A LoRA adapter on the vision tower's q projections only (B != 0)."""
    mx.random.seed(9)
    w = {}
    for layer in range(len(model.vision_tower.vision_model.encoder.layers)):
        path = TOWER.format(layer)
        d = model.vision_tower.vision_model.encoder.layers[layer].self_attn.q_proj.weight.shape
        w[path + ".lora_a"] = 0.5 * mx.random.normal((d[1], 4))
        w[path + ".lora_b"] = 0.5 * mx.random.normal((4, d[0]))
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), w)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": -1,
        "lora_parameters": {"rank": 4, "dropout": 0.0, "scale": 2.0, "keys": ["self_attn.q_proj"]}}))
    return str(out)


@pytest.fixture(scope="module")
def vis(tmp_path_factory):
    path = ensure_vision_fixture("bfloat16")
    model, _ = load_model(path)
    adapters = AdapterRegistry(model)
    adapters.mount("V", _tower_adapter(model, tmp_path_factory.mktemp("v") / "V"))
    return path, model, load_tokenizer(path), adapters


def _run(vis, max_batch, adapter):
    path, model, tok, adapters = vis
    eng = Engine(model, tok, max_batch=max_batch, adapters=adapters, keep_logprob_arrays=True)
    eng.image_preprocess = preprocessor_for(model, path)
    eng.eos = set()
    ids, vision = eng.vision_prompt(MSG, [_png(1)])
    text = eng.submit(list(range(5, 25)), SamplingParams(max_tokens=6, temperature=0.0))
    rid = eng.submit(ids, SamplingParams(max_tokens=6, temperature=0.0), adapter=adapter,
                     vision=vision)
    toks, lps = {rid: [], text: []}, {rid: [], text: []}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            toks[o.request_id] += o.token_ids
            lps[o.request_id] += o.logprob_arrays
    return toks[rid], lps[rid]


def test_image_row_with_a_tower_adapter_equals_the_request_run_alone(vis):
    solo = _run(vis, 1, ("V",))
    row = _run(vis, 4, ("V",))
    assert solo[0] == row[0]
    assert all(mx.array_equal(a, b).item() for a, b in zip(solo[1], row[1]))
    base = _run(vis, 1, ())          # (control: the adapter does change the answer)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(solo[1], base[1]))
