"""Segmented vs full backward, per tensor: relative norm and bit-exactness.

    python -m tests.train.segment_report            # markdown tables on stdout

Used by tests/train/test_segmented.py and quoted in docs/training.md.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.loader import load_model
from engine.adapters.lora import apply_lora
from parity.fixtures.models import ensure_fixture
from tests.train.helpers import FAMILIES, LORA, flat, inject_b, kv_sharing_config, random_batch, rel_norm
from train.loss import sft_loss
from train.checkpoint import donors
from train.segmented import plan_segments, segmented_value_and_grad


def lora_model(family=None, dtype="float32", config=None, seed=11):
    if config is not None:
        from engine.models import build
        mx.random.seed(0)
        m = build(config)
        m.set_dtype(mx.float32 if dtype == "float32" else mx.bfloat16)
    else:
        m = load_model(ensure_fixture(family, dtype))[0]
    mx.random.seed(seed)
    apply_lora(m, **LORA)
    inject_b(m, seed=3)
    return m


_BASE = {}


def full_backward(model, vocab=1000):
    """Loss and gradients of the plain full backward (cached per model)."""
    key = (id(model), vocab)
    if key not in _BASE:
        batch, lengths = random_batch(vocab=vocab, T=33)
        (l0, _), g0 = nn.value_and_grad(model, sft_loss)(model, batch, lengths)
        mx.eval(l0, g0)
        _BASE[key] = (model, l0, flat(g0))  # keep the model alive: ids stay unique
    return _BASE[key][1:]


def compare(model, segment_size, head="full", exact_kv_order=True, vocab=1000, **kw):
    """`kw`: further options of segmented_value_and_grad (mlp_chunk, token_chunk)."""
    batch, lengths = random_batch(vocab=vocab, T=33)
    l0, g0 = full_backward(model, vocab)
    (l1, _), g1 = segmented_value_and_grad(model, batch, lengths, segment_size, head=head,
                                           chunk_size=16, exact_kv_order=exact_kv_order, **kw)
    g1 = flat(g1)
    rel = {k: rel_norm(g1[k], g0[k]) for k in g0}
    exact = {k: bool(mx.array_equal(g1[k], g0[k]).item()) for k in g0}
    return {"loss_exact": bool(mx.array_equal(l0, l1).item()), "rel": rel, "exact": exact,
            "max_rel": max(rel.values()), "n_exact": sum(exact.values()), "n": len(exact)}


def presummed_cuts(model, segment_size) -> bool:
    """True when pre-summing a segment's sharers re-associates the full backward's
    sum: a segment holds >= 2 sharers of an earlier donor whose cotangent
    accumulator already holds a later segment's contribution."""
    d = donors(model)
    seen = set()
    for lo, hi in reversed(plan_segments(len(d), segment_size)):
        ext = [d[i] for i in range(lo, hi) if d[i] != i and d[i] < lo]
        if any(ext.count(x) >= 2 and x in seen for x in ext):
            return True
        seen.update(ext)
    return False


def main():
    print("| family | dtype | S | loss exact | tensors exact | max rel norm |")
    print("|---|---|---|---|---|---|")
    for fam in FAMILIES:
        for dt in ("float32", "bfloat16"):
            m = lora_model(fam, dt)
            n = len(m.layers)
            for S in sorted({1, 2, 3, n}):
                r = compare(m, S)
                print(f"| {fam} | {dt} | {S} | {r['loss_exact']} | {r['n_exact']}/{r['n']} | "
                      f"{r['max_rel']:.2e} |")
    cfg = kv_sharing_config()
    print("\nKV sharing with several sharers per donor (10 layers, donors "
          f"{tuple(lora_model(config=cfg).donor)}):\n")
    print("| dtype | S | KV-cotangent order | pre-summed cut | tensors exact | max rel norm |")
    print("|---|---|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        m = lora_model(config=cfg, dtype=dt)
        for S in range(1, 11):
            for exact in (True, False):
                r = compare(m, S, exact_kv_order=exact, vocab=256)
                print(f"| {dt} | {S} | {'per sharer' if exact else 'pre-summed'} | "
                      f"{presummed_cuts(m, S)} | {r['n_exact']}/{r['n']} | {r['max_rel']:.2e} |")


if __name__ == "__main__":
    main()
