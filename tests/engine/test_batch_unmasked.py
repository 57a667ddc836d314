"""A batch that has held one row from its start runs as mlx_lm.generate does: no mask to decode
(so CUDA runs MLX's fused vector attention, as the exact runner does) and "causal" to prefill
(cuDNN's causal attention, no bias tensor); the values equal mlx-lm's BatchGenerator, which
passes its boolean masks, on the CPU. Two rows or more, or a row left alone after others
leave, keep BatchGenerator's masks."""

import random

import mlx.core as mx
import pytest

from engine.kv.batch_cache import BatchKVCache
from engine.loader import load_model
from parity.batch import Insert, compare, run_mlx_lm, run_ours
from parity.fixtures.models import ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle


def _filled(pads, T=5):
    c = BatchKVCache(pads)
    kv = mx.zeros((len(pads), 2, T, 8))
    c.update_and_fetch(kv, kv)
    return c


def test_mask_only_where_needed():
    assert _filled([0]).make_mask(1) is None                 # a lone unpadded row
    assert isinstance(_filled([0, 0, 0]).make_mask(1), mx.array)        # rows: the mask
    assert isinstance(_filled([0, 2]).make_mask(1), mx.array)
    assert isinstance(_filled([0]).make_mask(1, window_size=3), mx.array)  # a window cuts
    assert _filled([0]).make_mask(1, window_size=64) is None
    assert _filled([0]).make_mask(2) == "causal"             # a lone row's chunk
    assert isinstance(_filled([0]).make_mask(2, return_array=True), mx.array)
    assert isinstance(_filled([0, 0]).make_mask(2), mx.array)           # rows: the mask
    assert isinstance(_filled([0]).make_mask(4, window_size=8), mx.array)  # 5 + 4 > 8
    assert _filled([0]).make_mask(3, window_size=8) == "causal"
    c = _filled([0, 0])
    c.filter([0])                                            # left alone: still the mask
    assert isinstance(c.make_mask(1), mx.array)
    c = _filled([0])
    c.filter([0])                                            # (keeping every row changes nothing)
    assert c.make_mask(1) is None
    c.extend(_filled([0], T=2))                              # a second row joins
    assert isinstance(c.make_mask(1), mx.array)
    empty = BatchKVCache([])
    empty.extend(_filled([0]))                               # a lone row into an empty batch
    assert empty.make_mask(1) is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_unmasked_steps_equal_batchgenerator(family, monkeypatch):
    path = str(ensure_fixture(family, "float32"))
    ours_m, ref_m = load_model(path)[0], oracle.load_model(path)
    rng = random.Random(1)
    lone = [Insert(0, [rng.randrange(4, 1000) for _ in range(9)], 12)]
    same = [Insert(0, [rng.randrange(4, 1000) for _ in range(7)], 10) for _ in range(3)]
    seen = []                     # per attention call: a decode step without a mask
    chunks = []                   # per prompt chunk: its mask was "causal"
    real = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, **kw):
        seen.append(mask is None and q.shape[2] == 1)
        if q.shape[2] > 1:
            chunks.append(isinstance(mask, str) and mask == "causal")
        return real(q, k, v, scale=scale, mask=mask, **kw)
    for sched in (lone, same):
        ref = run_mlx_lm(ref_m, sched)
        seen.clear()
        chunks.clear()
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        ours = run_ours(ours_m, sched)
        monkeypatch.undo()
        assert any(seen) == (sched is lone)  # only the lone row decodes without a mask
        assert chunks and all(chunks) == (sched is lone) and any(chunks) == (sched is lone)
        assert not compare(ours, ref)
