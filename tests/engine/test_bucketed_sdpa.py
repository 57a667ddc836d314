"""engine.models.bucketed_sdpa: on CUDA, a multi-token query's attention over padded shapes
(query rows and key columns to buckets, an additive mask) so cuDNN's plans recur. On the
H100 it equals the exact call bit for bit (experiments/sdpa_plan_probe.py,
reports/sdpa_plan/0.5.4); here, on the CPU (MLX's fallback ops), the same padded call is run by
forcing the route on and must equal the exact call too: the padding adds exact zeros. Also:
the buckets, the mask (real block, padded columns, padded rows) and the route (CUDA only,
multi-token queries, boolean or no mask)."""

import mlx.core as mx
import pytest

from engine.models import base
from engine.models import bucketed_sdpa as B

CASES = [(5, 300, "causal"), (400, 3000, "causal"), (3, 40, None), (7, 513, "bool"),
         (16, 16, "causal"), (33, 1000, "prefix"), (2, 257, "causal")]


@pytest.mark.parametrize("T,L,kind", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_padded_call_equals_the_exact_call(T, L, kind, dtype, monkeypatch):
    mx.random.seed(T * 1000 + L)
    q = mx.random.normal((2, 4, T, 16)).astype(dtype)
    k = mx.random.normal((2, 2, L, 16)).astype(dtype)
    v = mx.random.normal((2, 2, L, 16)).astype(dtype)
    if kind == "bool":
        mask = (mx.random.uniform(shape=(2, 1, T, L)) > 0.3) | (mx.arange(L) == 0)
    elif kind == "prefix":
        mask = (mx.arange(L)[None] <= mx.arange(L - T, L)[:, None])[None, None]
    else:
        mask = kind
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    monkeypatch.setattr(B, "on_cuda", lambda: True)
    assert B.takes(q, k, mask)
    got = base.attention(q, k, v, None, 0.25, mask)
    assert got.shape == want.shape
    assert mx.array_equal(got, want).item(), mx.abs(got - want).max().item()
    # control: a mask that also keeps the padding is not the exact call
    Tb, Lb = B.bucket(T, 16), B.bucket(L, 256)
    if Lb > L:
        loose = mx.zeros((1, 1, Tb, Lb), dtype=dtype)
        pad = mx.zeros((2, 2, Lb - L, 16), dtype=dtype)
        qp = mx.concatenate([q, mx.zeros((2, 4, Tb - T, 16), dtype=dtype)], axis=2)
        bad = mx.fast.scaled_dot_product_attention(
            qp, mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2),
            scale=0.25, mask=loose)[:, :, :T]
        assert not mx.array_equal(bad, want).item()


def test_buckets_and_the_mask():
    assert [B.bucket(n, 256) for n in (1, 256, 257, 1000, 17000, 17400, 20480, 20481)] == \
        [256, 256, 512, 1024, 20480, 20480, 20480, 24576]
    assert B.bucket(400, 16) == 448 and B.bucket(5, 16) == 16
    m = B.padded_mask("causal", 3, 5, 4, 7, mx.float32)[0, 0]
    inf = float("inf")
    assert m.tolist() == [[0, 0, 0, -inf, -inf, -inf, -inf],
                          [0, 0, 0, 0, -inf, -inf, -inf],
                          [0, 0, 0, 0, 0, -inf, -inf],
                          [0, 0, 0, 0, 0, -inf, -inf]]


def test_route():
    q1, q2, k = mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 2, 8)), mx.zeros((1, 1, 4, 8))
    assert not B.takes(q2, k, "causal")            # the CPU: never
    B_on = B.on_cuda
    try:
        B.on_cuda = lambda: True
        assert B.takes(q2, k, None) and B.takes(q2, k, "causal")
        assert B.takes(q2, k, mx.ones((2, 4), dtype=mx.bool_))
        assert not B.takes(q1, k, "causal")                     # one token: MLX's decoding path
        with B.exact_shapes():                                  # (the trainer's steps)
            assert not B.takes(q2, k, "causal")
        assert B.takes(q2, k, "causal")
        assert not B.takes(q2, k, mx.zeros((2, 4)))             # an additive mask: as given
        # the padded mask [B, H, Tb, Lb] past MAX_MASK_BYTES (1 GiB): 32 heads, bf16, one
        # row: 2048 queries over 8K keys is the bound; 4 rows: 2K keys
        qb = mx.zeros((1, 32, 2048, 8), dtype=mx.bfloat16)
        assert B.takes(qb, mx.zeros((1, 8, 8192, 8)), "causal")
        assert not B.takes(qb, mx.zeros((1, 8, 8193, 8)), "causal")
        q4 = mx.zeros((4, 32, 2048, 8), dtype=mx.bfloat16)
        rows = mx.ones((4, 1, 2048, 2048), dtype=mx.bool_)
        assert B.takes(q4, mx.zeros((4, 8, 2048, 8)), rows)
        assert not B.takes(q4, mx.zeros((4, 8, 2049, 8)), rows)
    finally:
        B.on_cuda = B_on


def test_a_big_mask_is_not_kept(monkeypatch):
    """The mask shared by a forward's layers outlives the forward: only a small one is kept."""
    monkeypatch.setattr(B, "on_cuda", lambda: True)
    q, k = mx.zeros((1, 2, 3, 8)), mx.zeros((1, 1, 300, 8))
    B.sdpa(q, k, k, 0.5, "causal")
    assert B._LAST.v is not None and B._LAST.v[2].shape == (1, 1, 16, 512)   # one mask for every head
    monkeypatch.setattr(B, "KEEP_MASK_BYTES", 1024)
    k2 = mx.zeros((1, 1, 301, 8))                      # (another shape: a new mask)
    B.sdpa(q, k2, k2, 0.5, "causal")
    assert B._LAST.v is None


def test_warm_next_runs_the_next_turns_shape_once(monkeypatch):
    """While idle, the call the next turn would make runs once on zeros (its cuDNN plan built
    then, not on that turn's first token): the last call's queries over the ended length plus
    as many keys; not when that bucket has run already, nor twice."""
    monkeypatch.setattr(B, "on_cuda", lambda device=None: True)
    monkeypatch.setattr(B, "_SEEN", set())
    monkeypatch.setattr(B, "_CALL", None)
    assert not B.warm_next(100)                              # no call yet
    q, k = mx.zeros((1, 2, 40, 8)), mx.zeros((1, 1, 300, 8))
    B.sdpa(q, k, k, 0.5, "causal")                           # 40 queries, 300 keys: 48 x 512
    assert not B.warm_next(400)                              # 440 keys: bucket 512, run already
    calls = []
    real = B.sdpa
    monkeypatch.setattr(B, "sdpa", lambda *a: calls.append(a) or real(*a))
    assert B.warm_next(500)                                  # 540 keys: bucket 768, new
    (wq, wk, _, _, wmask), = calls
    assert wq.shape == (1, 2, 40, 8) and wk.shape == (1, 1, 540, 8) and wmask == "causal"
    assert (1, 2, 1, 8, mx.float32, 48, 768, "causal") in B._SEEN
    assert not B.warm_next(500)                              # once
    # a boolean mask: the warm call's mask has the same leading shape (the same plan key)
    real(q, k, k, 0.5, mx.ones((1, 1, 40, 300), dtype=mx.bool_))
    calls.clear()
    assert B.warm_next(1000)
    m = calls[0][4]
    assert m.dtype == mx.bool_ and m.shape == (1, 1, 40, 1040)
    real(mx.zeros((2, 2, 40, 8)), mx.zeros((2, 1, 300, 8)), mx.zeros((2, 1, 300, 8)), 0.5, "causal")
    assert not B.warm_next(2000)                             # after a call of several rows: no
    real(q, k, k, 0.5, "causal")
    monkeypatch.setattr(B, "on_cuda", lambda device=None: False)
    assert not B.warm_next(5000)                             # elsewhere: nothing


def test_engine_idle_warms_for_the_request_that_ended(monkeypatch):
    """Engine.idle passes the ended request's length (prompt + generated) once, and only when
    nothing runs."""
    from engine import Engine, SamplingParams
    import engine
    import engine.step.core as core
    from starter.models import ensure_fixture
    seen = []
    monkeypatch.setattr(core, "warm_next", lambda n: seen.append(n) or True)
    model, tok = engine.load(str(ensure_fixture("llama")))
    eng = Engine(model, tok, max_batch=4)
    assert not eng.idle() and seen == []                     # nothing ended yet
    eng.submit([5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0))
    eng.submit([5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
        assert eng.has_unfinished() or seen == []
    assert eng.idle() and seen == [3 + 30]                   # the last one to end
    assert not eng.idle() and seen == [33]                   # once


def test_warm_turns_runs_every_query_bucket_over_the_stored_length_once(monkeypatch):
    """A restarted server's warm-up (`engine.step.warmup`, with a stored prefix) runs the calls
    a next turn over that prefix would make: one per query bucket up to `most` tokens, over the
    stored length plus that many keys, each (bucket pair, shape) once; off CUDA none."""
    assert B.warm_turns([(2, 1, 8, mx.float32)], 300) == 0          # (the CPU: nothing)
    monkeypatch.setattr(B, "on_cuda", lambda device=None: True)
    monkeypatch.setattr(B, "_SEEN", set())
    calls = []
    real = B.sdpa
    monkeypatch.setattr(B, "sdpa", lambda *a: calls.append(a) or real(*a))
    shapes = [(2, 1, 8, mx.float32), (4, 2, 8, mx.bfloat16)]
    n = B.warm_turns(shapes, 300, most=100)
    tb = [16, 32, 48, 64, 80, 96, 112]          # the query buckets up to 100 (and 112 above it)
    assert n == len(calls) == 2 * len(tb)
    assert [c[0].shape[2] for c in calls[:len(tb)]] == tb
    assert all(c[1].shape[2] == 300 + c[0].shape[2] and c[4] == "causal" for c in calls)
    for Tb in tb:
        assert (1, 4, 2, 8, mx.bfloat16, Tb, B.bucket(300 + Tb, 256), "causal") in B._SEEN
    assert B.warm_turns(shapes, 300, most=100) == 0                 # once


def test_attention_shapes_of_a_model():
    from engine.step.warmup import attention_shapes
    from parity.fixtures.models import ensure_fixture
    import engine
    model, _ = engine.load(str(ensure_fixture("qwen3", "bfloat16")))
    [(H, Hkv, D, dtype)] = attention_shapes(model)
    a = model.layers[0].self_attn
    assert (H, Hkv, D, dtype) == (a.n_heads, a.n_kv_heads, a.head_dim, mx.bfloat16)
