"""L2: per-layer mixed-precision KV (`kv_config`) bit-exact with mlx-optiq 0.7.7's
`install_mixed_kv` over mlx-lm's generation: logits at every step of the comparison
schedule, and mlx-lm's `generate_step` tokens/logprobs vs our token loop."""

import mlx.core as mx
import numpy as np
import pytest

from engine.kv.quant import KVConfigError, make_policy
from engine.loader import load_model
from engine.step.stepper import generate_step
from parity import checks
from parity.fixtures.models import ensure_fixture
from parity.oracles.optiq_oracle import mixed_kv_reference

pytestmark = pytest.mark.parity

CONFIGS = {
    # layers without an entry stay float; sliding-window layers included for Gemma 4
    "llama": [{"layer_idx": 0, "bits": 4, "group_size": 64}],
    "qwen3": [{"layer_idx": 1, "bits": 8, "group_size": 32}],
    "minicpm": [{"layer_idx": 0, "bits": 8, "group_size": 32}, {"layer_idx": 1, "bits": 4, "group_size": 32}],
    "gemma4_text": [{"layer_idx": 0, "bits": 8, "group_size": 32}, {"layer_idx": 2, "bits": 4, "group_size": 32},
                    {"layer_idx": 3, "bits": 4, "group_size": 32}],
    "gemma4": [{"layer_idx": 1, "bits": 4, "group_size": 32}, {"layer_idx": 5, "bits": 8, "group_size": 64}],
}


@pytest.mark.parametrize("start", [0, 12])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_mixed_kv_matches_optiq(family, start):
    path = ensure_fixture(family)
    prompt = checks.prompt_ids(40)
    steps = 16
    ref = mixed_kv_reference(path, prompt, steps, CONFIGS[family], start)
    model = load_model(path)[0]
    policy = make_policy(model, kv_config=CONFIGS[family], quantized_kv_start=start)
    caches = model.make_cache()
    p = mx.array(prompt)[None]
    ours = [model(p[:, :-1], cache=caches)]
    policy.apply(caches)
    tok = p[:, -1:]
    for _ in range(steps + 1):
        lg = model(tok, cache=caches)
        policy.apply(caches)
        ours.append(lg)
        tok = mx.argmax(lg[:, -1], axis=-1)[:, None]
    assert [i for i, c in enumerate(caches) if c.bits] == sorted(ref["quantized_layers"].tolist())
    assert sorted(e["layer_idx"] for e in CONFIGS[family]) == ref["quantized_layers"].tolist()
    for i, lg in enumerate(ours):
        assert np.array_equal(np.array(lg.astype(mx.float32)), ref[f"logits_{i}"]), f"step {i}"
    got = list(generate_step(mx.array(prompt), model, max_tokens=steps,
                             policy=make_policy(model, kv_config=CONFIGS[family], quantized_kv_start=start)))
    assert [t for t, _ in got] == ref["tokens"].tolist()
    assert np.array_equal(np.stack([np.array(lp) for _, lp in got]), ref["logprobs"])


def test_kv_config_errors_are_clear(tmp_path):
    model = load_model(ensure_fixture("qwen3"))[0]
    with pytest.raises(KVConfigError, match="out of range"):
        make_policy(model, kv_config=[{"layer_idx": 9, "bits": 4}])
    with pytest.raises(KVConfigError, match="divisible"):
        make_policy(model, kv_config=[{"layer_idx": 0, "bits": 4, "group_size": 64}])
    with pytest.raises(KVConfigError, match="bits"):
        make_policy(model, kv_bits=7, kv_group_size=32)
    bad = tmp_path / "kv.json"
    bad.write_text("{not json")
    with pytest.raises(KVConfigError, match="invalid JSON"):
        make_policy(model, kv_config=str(bad))
    with pytest.raises(KVConfigError, match="not found"):
        make_policy(model, kv_config=str(tmp_path / "missing.json"))
