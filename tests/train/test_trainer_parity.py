"""L1: a few optimiser steps of our trainer give the adapter weights mlx-lm's
trainer gives (`mlx_lm.lora.train_model`, the function its CLI runs), bit for bit.

Same fixture, same data directory, same seed and settings: validation passes at
iteration 1 / steps_per_eval / the end (they draw from the same shuffling
state), gradient accumulation, each optimiser.
"""

import types

import mlx.core as mx
import numpy as np
import pytest

from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from parity.fixtures.models import ensure_fixture
from tests.train.helpers import FAMILIES, not_equal, write_upper_data
from train.data import load_data_dir
from train.trainer import TrainConfig, train

pytestmark = pytest.mark.parity

COMMON = dict(iters=4, batch_size=4, learning_rate=1e-3, seed=0, steps_per_eval=3,
              val_batches=1, steps_per_report=2, save_every=100)
_REF = {}


def run_mlx_lm(path, data, out, optimizer="adam", G=2, optimizer_config=None):
    """mlx-lm's adapter after the run (cached per setting within the session)."""
    key = (str(path), str(data), optimizer, G, repr(optimizer_config))
    if key not in _REF:
        _REF[key] = _run_mlx_lm(path, data, out, optimizer, G, optimizer_config)
    return _REF[key]


def _run_mlx_lm(path, data, out, optimizer, G, optimizer_config):
    import mlx_lm
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset
    over = dict(model=str(path), train=True, data=str(data), num_layers=-1, mask_prompt=True,
                adapter_path=str(out), grad_accumulation_steps=G, optimizer=optimizer, **COMMON)
    if optimizer_config:
        over["optimizer_config"] = {optimizer: optimizer_config}
    args = types.SimpleNamespace(**{**CONFIG_DEFAULTS, **over})
    np.random.seed(args.seed)  # what mlx_lm.lora.run does first
    model, tok = mlx_lm.load(str(path))
    tr, va, _ = load_dataset(args, tok)
    train_model(args, model, tr, va)
    return mx.load(str(out / "adapters.safetensors"))


def run_ours(path, data, out, **kw):
    model = load_model(path)[0]
    d = load_data_dir(data, load_tokenizer(path), mask_prompt=True)
    cfg = TrainConfig(model=str(path), data=str(data), adapter_path=str(out), num_layers=-1,
                      **COMMON, **kw)
    hist, _ = train(model, cfg, d["train"], d["valid"], log=lambda *_: None)
    return mx.load(str(out / "adapters.safetensors")), hist


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_upper_data(tmp_path_factory.mktemp("data"), n_train=16, n_valid=8)


@pytest.mark.parametrize("family,dtype", [(f, "float32") for f in FAMILIES] +
                         [("llama", "bfloat16"), ("gemma4_text", "bfloat16"), ("qwen3", "q4")])
def test_adam_steps_equal_mlx_lm_trainer(family, dtype, data, tmp_path):
    p = ensure_fixture(family, dtype)
    ref = run_mlx_lm(p, data, tmp_path / "ref")
    ours, hist = run_ours(p, data, tmp_path / "ours", grad_accumulation=2)
    assert not not_equal(ref, ours)
    assert [h["iteration"] for h in hist if "val_loss" in h] == [1, 3, 4]


@pytest.mark.parametrize("mode", [dict(compile=False), dict(grad_checkpoint=True),
                                  dict(segment_size=1, loss_head="chunked", chunk_size=16),
                                  dict(segment_size=2, loss_head="gather")],
                         ids=["eager", "grad-checkpoint", "segmented1-chunked", "segmented2-gather"])
@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_memory_modes_equal_mlx_lm_trainer(family, mode, data, tmp_path):
    """Checkpointed, segmented and response-only-head training: still the same bits."""
    p = ensure_fixture(family)
    ref = run_mlx_lm(p, data, tmp_path / "ref")
    ours, _ = run_ours(p, data, tmp_path / "ours", grad_accumulation=2, **mode)
    assert not not_equal(ref, ours)


@pytest.mark.parametrize("optimizer,conf", [("adamw", None), ("adamw", {"weight_decay": 0.1}),
                                            ("sgd", None), ("sgd", {"momentum": 0.9})])
def test_optimizers_equal_mlx_lm_trainer(optimizer, conf, data, tmp_path):
    p = ensure_fixture("qwen3")
    ref = run_mlx_lm(p, data, tmp_path / "ref", optimizer=optimizer, G=1, optimizer_config=conf)
    kw = {}
    if conf and "weight_decay" in conf:
        kw["weight_decay"] = conf["weight_decay"]
    if conf and "momentum" in conf:
        kw["momentum"] = conf["momentum"]
    ours, _ = run_ours(p, data, tmp_path / "ours", optimizer=optimizer, **kw)
    assert not not_equal(ref, ours)
