"""engine.models.composed_sdpa: MLX's fallback of scaled_dot_product_attention written out.

On the CPU MLX always runs that fallback, so `sdpa` must give the very bits of
`mx.fast.scaled_dot_product_attention` for every mask kind speculation passes (none, "causal",
a boolean array per row with padding, an additive array), grouped-query heads or not, f32 /
bf16 / f16. A control shows the check can fail: the same chain with the scale applied after
the matmul (mathematically equal) differs somewhere. `speculating()` routes only 2..MAX_QUERY
query tokens, on its own thread, and restores the state on exit (errors too)."""

import threading

import mlx.core as mx
import pytest

from engine.models import composed_sdpa as C
from engine.models.base import attention


def _qkv(dtype, B=3, H=8, H_kv=2, L=5, S=37, D=64, seed=0):
    mx.random.seed(seed)
    q = (mx.random.normal((B, H, L, D)) * 2).astype(dtype)
    k = (mx.random.normal((B, H_kv, S, D)) * 2).astype(dtype)
    v = mx.random.normal((B, H_kv, S, D)).astype(dtype)
    return q, k, v


def _masks(B, L, S):
    keep = mx.random.uniform(shape=(B, 1, L, S)) > 0.2
    keep = mx.logical_or(keep, (mx.arange(S) == S - 1)[None, None, None])   # (no empty row)
    rows = mx.arange(S)[None, None, None] >= mx.array([0, 3, 9])[:, None, None, None]
    return {"none": None, "causal": "causal", "bool": keep,
            "padded": mx.logical_and(rows, mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]),
            "additive": mx.where(keep, 0.0, -1e9).astype(mx.float32)}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "padded", "additive"])
def test_sdpa_equals_mlx_bit_for_bit(dtype, heads, kind):
    q, k, v = _qkv(dtype, H=heads[0], H_kv=heads[1])
    mask = _masks(3, 5, 37)[kind]
    if kind == "additive":
        mask = mask.astype(dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = C.sdpa(q, k, v, 0.125, mask)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert mx.array_equal(got, want).item()


def test_a_reordered_chain_is_caught():
    """Control: scaling the scores instead of q (equal in exact arithmetic) changes bits."""
    q, k, v = _qkv(mx.bfloat16, L=8, S=300, D=128, seed=3)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.0883883, mask="causal")
    qq = mx.reshape(q, (3, 2, 4, 8, 128))
    s = mx.matmul(qq, mx.swapaxes(mx.expand_dims(k, 2), -1, -2)) * mx.array(0.0883883, mx.bfloat16)
    m = mx.arange(292, 300)[:, None] >= mx.arange(300)[None]
    s = mx.softmax(mx.where(m, s, mx.array(mx.finfo(mx.bfloat16).min, mx.bfloat16)), axis=-1,
                   precise=True)
    wrong = mx.reshape(mx.matmul(s, mx.expand_dims(v, 2)), (3, 8, 8, 128))
    assert not mx.array_equal(wrong, want).item()
    assert mx.array_equal(C.sdpa(q, k, v, 0.0883883, "causal"), want).item()


def test_speculating_routes_short_multi_token_queries_only(monkeypatch):
    calls = []
    real = C.sdpa
    monkeypatch.setattr(C, "sdpa", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    for L in (1, 2, C.MAX_QUERY, C.MAX_QUERY + 1):
        q, k, v = _qkv(mx.float32, L=L, S=40)
        attention(q, k, v, None, 0.125, "causal" if L > 1 else None)
        with C.speculating():
            attention(q, k, v, None, 0.125, "causal" if L > 1 else None)
    assert calls == [2, C.MAX_QUERY]
    q = _qkv(mx.float32, L=4)[0]
    seen = []
    with C.speculating():                       # another thread is not speculating
        t = threading.Thread(target=lambda: seen.append(C.takes(q)))
        t.start()
        t.join()
    assert seen == [False]
    with pytest.raises(RuntimeError):
        with C.speculating():
            raise RuntimeError("boom")
    assert not C.takes(q)
