"""The quantized-KV quality measurement runs and orders the modes as it must:
8-bit closer to float than mixed 8/4, which is closer than 4-bit."""

import pytest

from engine.loader import load_model
from parity.fixtures.models import ensure_fixture
from parity.kv_quality import measure, prompts


@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_kl_orders_modes(family):
    model = load_model(ensure_fixture(family, "bfloat16"))[0]
    r = measure(model, prompts(n=2, length=40), steps=16)
    assert set(r) == {"kv8", "kv4", "mixed8/4"}
    for m in r.values():
        assert m["tokens"] == 2 * 17
        assert 0 <= m["kl_median"] <= m["kl_p99"] <= m["kl_max"]
        assert 0 < m["kl_mean"]
    assert r["kv8"]["kl_mean"] < r["mixed8/4"]["kl_mean"] < r["kv4"]["kl_mean"]
    assert r["kv8"]["top1_agreement"] >= 0.8
