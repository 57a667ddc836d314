"""Shared helpers for the training tests (tiny fixtures, tiny datasets)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

FAMILIES = ["llama", "qwen3", "minicpm", "gemma4_text", "gemma4"]
LORA = {"rank": 4, "scale": 20.0, "dropout": 0.0}

WORDS = ("apple river stone cloud green quick slow bright dark music paper ocean tiger "
         "silver window garden").split()


def write_upper_data(d, n_train=32, n_valid=8, seed=0, fmt="messages"):
    """A tiny learnable task: answer = the user's words in uppercase."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    r = random.Random(seed)

    def row():
        w = " ".join(r.choice(WORDS) for _ in range(r.randint(2, 5)))
        if fmt == "messages":
            return {"messages": [{"role": "system", "content": "Answer in uppercase."},
                                 {"role": "user", "content": w},
                                 {"role": "assistant", "content": w.upper()}]}
        if fmt == "completions":
            return {"prompt": w, "completion": w.upper()}
        return {"text": f"{w} -> {w.upper()}"}

    for name, n in (("train", n_train), ("valid", n_valid)):
        with open(d / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps(row()) + "\n")
    return d


def flat(tree) -> dict:
    return dict(tree_flatten(tree))


def rel_norm(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    nb = mx.linalg.norm(b).item()
    d = mx.linalg.norm(a - b).item()
    return d / nb if nb else d


def not_equal(a: dict, b: dict) -> list:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:6]
    return [k for k in sorted(a) if not mx.array_equal(a[k], b[k]).item()]


def random_batch(vocab=1000, B=2, T=41, seed=0):
    rng = np.random.RandomState(seed)
    batch = mx.array(rng.randint(4, vocab, size=(B, T)).astype(np.int32))
    # row 0: prompt of 5, length 30 (one pad target counted); row 1: full width, no pad
    lengths = mx.array([[5, 30], [0, T]])
    return batch, lengths


def inject_b(*models, scale=0.05, seed=0):
    """Give every lora_b the same random values in all models (B = 0 would make
    every dA zero and the A gradients vacuous)."""
    names = sorted(k for k in flat(models[0].trainable_parameters()) if k.endswith("lora_b"))
    shapes = flat(models[0].trainable_parameters())
    upd = [(k, scale * mx.random.normal(shapes[k].shape, key=mx.random.key(seed + i)))
           for i, k in enumerate(names)]
    for m in models:
        m.load_weights(upd, strict=False)


def kv_sharing_config(n_layers=10, n_shared=6):
    """A Gemma 4 text config where each donor has several sharers."""
    from parity.fixtures.models import FAMILIES as FX
    cfg = copy.deepcopy(FX["gemma4_text"])
    pattern = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg.update(vocab_size=256, vocab_size_per_layer_input=256, rms_norm_eps=1e-6,
               max_position_embeddings=4096, num_hidden_layers=n_layers,
               num_kv_shared_layers=n_shared,
               layer_types=(pattern * n_layers)[:n_layers])
    return cfg


def write_word_data(d, n_train=32, n_valid=8, seed=0, words=("apple", "river", "stone", "cloud")):
    """An easily learnable task for tiny random models: the answer is the user's
    one word in uppercase."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    r = random.Random(seed)
    for name, n in (("train", n_train), ("valid", n_valid)):
        with open(d / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                w = r.choice(words)
                f.write(json.dumps({"messages": [{"role": "user", "content": w},
                                                 {"role": "assistant", "content": w.upper()}]})
                        + "\n")
    return d
