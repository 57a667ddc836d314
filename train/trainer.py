"""LoRA SFT trainer: the loop, optimisers, validation, progress, checkpoints, resume.

The loop is mlx-lm 0.32.2's `tuner.trainer.train` step for step (so that with
the same seed and settings the adapter weights come out bit-identical - see
tests/train/test_trainer_parity.py):

- ``mx.random.seed(seed)`` before the LoRA layers are made (their A init), a
  ``RandomState(seed)`` for the batch order (train epochs and validation passes
  draw from it in mlx-lm's order);
- iteration ``it`` = 1..iters: fetch the batch, validate when ``it == 1``,
  ``it % steps_per_eval == 0`` or ``it == iters``, then one micro-step: loss and
  gradient, gradients summed over ``grad_accumulation`` micro-steps and divided
  by it at the update (``it % G == 0``);
- the full-backward step is ``mx.compile``d with the model, optimiser and PRNG
  state as inputs/outputs, as mlx-lm compiles it.

Three backward modes: full (default), ``grad_checkpoint`` (each block under
``mx.checkpoint``) and ``segment_size > 0`` (segmented backward,
:mod:`train.segmented`). Loss heads: ``full`` / ``gather`` / ``chunked``
(:mod:`train.loss`).

Checkpoints: every ``save_every`` iterations the adapter is written to
``adapters.safetensors`` and ``{it:07d}_adapters.safetensors`` (mlx-lm's names),
plus ``training_state.json`` / ``training_state.safetensors`` (iteration,
optimiser state, batch-iterator and PRNG state, pending accumulated gradients)
so that ``resume=True`` continues exactly where the run stopped.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from engine.adapters.lora import adapter_config, adapter_weights, apply_lora, save_adapter
from engine.models.bucketed_sdpa import exact_shapes

from .data import BatchIterator, Dataset, rng_state, set_rng_state
from .distributed import DataParallel, data_parallel, silent
from .loss import HEADS, head_loss, hidden_states, sft_loss, split_batch
from .checkpoint import get_key, has_dropout, set_key
from .segmented import segmented_value_and_grad

OPTIMIZERS = ("adam", "adamw", "sgd")
STATE_JSON = "training_state.json"
STATE_TENSORS = "training_state.safetensors"


@dataclass
class TrainConfig:
    model: str = ""
    data: str = ""
    adapter_path: str = "adapters"
    iters: int = 100
    batch_size: int = 4
    learning_rate: float = 1e-5
    optimizer: str = "adam"
    weight_decay: Optional[float] = None   # adamw/sgd; None = mlx's default
    momentum: Optional[float] = None       # sgd
    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    num_layers: int = 16
    keys: Optional[list] = None
    max_seq_length: int = 2048
    grad_accumulation: int = 1
    grad_checkpoint: bool = False
    segment_size: int = 0
    mlp_chunk: int = 0          # with segment_size 1: MLP half in token chunks
    token_chunk: int = 0        # with segment_size 1: every per-token part in token chunks
    attn_block: int = 0         # with token_chunk: attention in query blocks (0 auto, -1 never)
    loss_head: str = "full"
    chunk_size: int = 1024
    val_batches: int = 25
    steps_per_report: int = 10
    steps_per_eval: int = 200
    save_every: int = 100
    seed: int = 0
    mask_prompt: bool = True
    compile: bool = True
    resume: bool = False
    resume_adapter_file: Optional[str] = None
    clear_cache_threshold: int = 0

    def validate(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: have {OPTIMIZERS}")
        if self.loss_head not in HEADS:
            raise ValueError(f"loss head {self.loss_head!r}: have {HEADS}")
        if self.grad_accumulation < 1:
            raise ValueError("grad_accumulation must be at least 1")
        if self.segment_size < 0:
            raise ValueError("segment_size must be >= 0")
        if self.mlp_chunk and self.segment_size != 1:
            raise ValueError("--mlp-chunk needs --segment-size 1")
        if self.token_chunk and self.segment_size != 1:
            raise ValueError("--token-chunk needs --segment-size 1")
        if self.token_chunk and self.mlp_chunk:
            raise ValueError("use either --token-chunk or --mlp-chunk, not both")
        if self.segment_size and self.grad_checkpoint:
            raise ValueError("use either --grad-checkpoint or --segment-size, not both")
        if self.iters < 1 or self.batch_size < 1:
            raise ValueError("iters and batch_size must be positive")


def make_optimizer(cfg: TrainConfig):
    kw = {}
    if cfg.optimizer == "adam":
        return optim.Adam(learning_rate=cfg.learning_rate)
    if cfg.optimizer == "adamw":
        if cfg.weight_decay is not None:
            kw["weight_decay"] = cfg.weight_decay
        return optim.AdamW(learning_rate=cfg.learning_rate, **kw)
    if cfg.weight_decay is not None:
        kw["weight_decay"] = cfg.weight_decay
    if cfg.momentum is not None:
        kw["momentum"] = cfg.momentum
    return optim.SGD(learning_rate=cfg.learning_rate, **kw)


def loss_and_grad_fn(model, cfg: TrainConfig) -> Callable:
    """(model, batch, lengths) -> ((loss, ntoks), grads) for the configured mode; attention
    at exact shapes (`engine.models.bucketed_sdpa.exact_shapes`: mlx-lm's kernels on CUDA)."""
    fn = _loss_and_grad_fn(model, cfg)

    def exact(m, b, l):
        with exact_shapes():
            return fn(m, b, l)
    return exact


def _loss_and_grad_fn(model, cfg: TrainConfig) -> Callable:
    if cfg.segment_size:
        return lambda m, b, l: segmented_value_and_grad(
            m, b, l, cfg.segment_size, head=cfg.loss_head, chunk_size=cfg.chunk_size,
            mlp_chunk=cfg.mlp_chunk, token_chunk=cfg.token_chunk, attn_block=cfg.attn_block)

    def loss(m, b, l):
        if not cfg.grad_checkpoint:
            return sft_loss(m, b, l, head=cfg.loss_head, chunk_size=cfg.chunk_size)
        inputs, targets, mask = split_batch(b, l)
        h = hidden_states(m, inputs, checkpoint=True)
        return head_loss(m, h, targets, mask, cfg.loss_head, cfg.chunk_size)

    return nn.value_and_grad(model, loss)


def evaluate(model, dataset: Dataset, batch_size: int, num_batches: int, max_seq_length: int,
             rng, head: str = "full", chunk_size: int = 1024,
             dp: Optional[DataParallel] = None) -> float:
    """Token-weighted validation loss over `num_batches` batches (-1 = one epoch)."""
    model.eval()
    total, ntok = mx.array(0.0), mx.array(0)
    it = BatchIterator(dataset, batch_size, max_seq_length, rng, loop=False)
    if dp is not None:  # DP: this rank's rows of each batch
        dp.shard_batches(it)
    count = 0
    while num_batches == -1 or count < num_batches:
        try:
            batch, lengths = next(it)
        except StopIteration:
            break
        with exact_shapes():
            loss, toks = sft_loss(model, batch, lengths, head=head, chunk_size=chunk_size)
        total = total + loss * toks
        ntok = ntok + toks
        mx.eval(total, ntok)
        count += 1
    if dp is not None:  # DP: loss and tokens summed over the ranks
        total, ntok = dp.sum(total), dp.sum(ntok)
    return (total / ntok).item()


def _bar(it, iters, width=20):
    k = int(width * it / iters)
    return "#" * k + "." * (width - k)


class Trainer:
    def __init__(self, model, cfg: TrainConfig, train_set: Dataset,
                 valid_set: Optional[Dataset] = None, log: Callable = print,
                 meta: Optional[dict] = None):
        cfg.validate()
        self.model, self.cfg, self.train_set, self.valid_set = model, cfg, train_set, valid_set
        self.dp = data_parallel()  # DP: one rank unless launched with mlx.launch
        self.dp.check_batch_size(cfg.batch_size)
        self.log = log if self.dp.is_main else silent  # DP: rank 0 logs
        self.meta = meta or {}
        self.out = Path(cfg.adapter_path)
        self.history: list[dict] = []

    # ---- setup
    def setup(self):
        cfg, model = self.cfg, self.model
        self.rng = np.random.RandomState(cfg.seed)
        mx.random.seed(cfg.seed)
        self.targets = apply_lora(model, cfg.rank, cfg.scale, cfg.dropout, cfg.num_layers,
                                  cfg.keys)
        if cfg.resume_adapter_file:
            model.load_weights(cfg.resume_adapter_file, strict=False)
        self.optimizer = make_optimizer(cfg)
        self.train_it = BatchIterator(self.train_set, cfg.batch_size, cfg.max_seq_length,
                                      self.rng, loop=True)
        self.dp.shard_batches(self.train_it)  # DP: this rank's rows of each batch
        self.start_it = 1
        self.grad_accum = None
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self._load_state()
        self.config_dict = self._adapter_config()
        if self.dp.is_main:  # DP: rank 0 writes
            (self.out / "adapter_config.json").write_text(json.dumps(self.config_dict, indent=4))
        self._build_step()

    def _adapter_config(self):
        c = asdict(self.cfg)
        extra = {k: v for k, v in c.items() if k not in ("rank", "scale", "dropout", "num_layers",
                                                       "keys")}
        extra.update(self.meta)
        extra["grad_accumulation_steps"] = self.cfg.grad_accumulation
        return adapter_config(self.cfg.rank, self.cfg.scale, self.cfg.dropout,
                              self.cfg.num_layers, self.cfg.keys, **extra)

    def _build_step(self):
        cfg, model, opt = self.cfg, self.model, self.optimizer
        vg = loss_and_grad_fn(model, cfg)
        G = cfg.grad_accumulation

        def step(batch, lengths, prev_grad, do_update):
            (loss, toks), grad = vg(model, batch, lengths)
            if prev_grad is not None:
                grad = tree_map(lambda g, p: g + p, grad, prev_grad)
            if do_update:
                grad = self.dp.average(grad)  # DP: mean over ranks, before the /G
                if G > 1:
                    grad = tree_map(lambda g: g / G, grad)
                opt.update(model, grad)
                grad = None
            return loss, toks, grad

        compilable = (cfg.compile and not cfg.segment_size and cfg.loss_head == "full"
                      and not (cfg.grad_checkpoint and has_dropout(model)))
        if compilable:
            self.state = [model.state, opt.state, mx.random.state]
            step = partial(mx.compile, inputs=self.state, outputs=self.state)(step)
        else:
            self.state = [model.state, opt.state]
        self.compiled = compilable
        self.step_fn = step

    # ---- checkpoints
    def save(self, it: int, final: bool = False):
        if not self.dp.is_main:  # DP: rank 0 writes
            return self.out
        w = adapter_weights(self.model)
        mx.save_safetensors(str(self.out / "adapters.safetensors"), w)
        if not final:
            mx.save_safetensors(str(self.out / f"{it:07d}_adapters.safetensors"), w)
        tensors = {f"opt.{k}": v for k, v in tree_flatten(self.optimizer.state)}
        if self.grad_accum is not None:
            tensors.update({f"grad.{k}": v for k, v in tree_flatten(self.grad_accum)})
        mx.save_safetensors(str(self.out / STATE_TENSORS), tensors)
        st = {"iteration": it, "rng": rng_state(self.rng), "train_iter": self.train_it.state(),
              "mx_key": list(get_key()), "has_grad_accum": self.grad_accum is not None,
              "config": asdict(self.cfg)}
        (self.out / STATE_JSON).write_text(json.dumps(st))
        return self.out

    def _load_state(self):
        f = self.out / STATE_JSON
        if not f.exists():
            raise FileNotFoundError(f"{f}: nothing to resume from")
        st = json.loads(f.read_text())
        if st["has_grad_accum"] and self.dp.size > 1:  # DP: pending grads are per rank
            raise ValueError(f"{f}: saved in the middle of a gradient accumulation; a "
                             "data-parallel run resumes only from a save at an update "
                             "(make --save-every a multiple of --grad-accumulation)")
        self.model.load_weights(str(self.out / "adapters.safetensors"), strict=False)
        tensors = mx.load(str(self.out / STATE_TENSORS))
        opt = self.optimizer
        opt.init(self.model.trainable_parameters())
        flat_opt = {k[4:]: v for k, v in tensors.items() if k.startswith("opt.")}
        opt.state = tree_map_with_path(lambda p, x: flat_opt.get(p, x), opt.state)
        if st["has_grad_accum"]:
            flat_g = {k[5:]: v for k, v in tensors.items() if k.startswith("grad.")}
            self.grad_accum = tree_map_with_path(lambda p, x: flat_g[p],
                                                 self.model.trainable_parameters())
        set_rng_state(self.rng, st["rng"])
        self.train_it.load_state(st["train_iter"])
        set_key(tuple(st["mx_key"]))
        self.start_it = st["iteration"] + 1
        self.log(f"Resuming from iteration {st['iteration']} ({self.out})")

    # ---- loop
    def validate_loss(self):
        cfg = self.cfg
        loss = evaluate(self.model, self.valid_set, cfg.batch_size, cfg.val_batches,
                        cfg.max_seq_length, self.rng, head=cfg.loss_head, chunk_size=cfg.chunk_size,
                        dp=self.dp)
        self.model.train()
        return loss

    def run(self):
        cfg, model = self.cfg, self.model
        self.setup()
        n_train = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
        n_total = sum(v.size for _, v in tree_flatten(model.parameters()))
        self.log(f"Trainable parameters: {100 * n_train / max(n_total, 1):.3f}% "
                 f"({n_train / 1e6:.3f}M/{n_total / 1e6:.3f}M), {len(self.targets)} LoRA layers; "
                 f"backward: {self.mode}, loss head {cfg.loss_head}"
                 f"{', compiled' if self.compiled else ''}")
        model.train()
        losses, n_tokens, steps, train_time, trained = 0, 0, 0, 0.0, 0
        G = cfg.grad_accumulation
        for it in range(self.start_it, cfg.iters + 1):
            batch, lengths = next(self.train_it)
            tic = time.perf_counter()
            if self.valid_set is not None and len(self.valid_set) >= cfg.batch_size and cfg.val_batches != 0 and (
                    it == 1 or it % cfg.steps_per_eval == 0 or it == cfg.iters):
                t0 = time.perf_counter()
                val = self.validate_loss()
                self.log(f"Iter {it}: Val loss {val:.3f}, Val took {time.perf_counter() - t0:.3f}s")
                self.history.append({"iteration": it, "val_loss": val})
                tic = time.perf_counter()
            loss, toks, self.grad_accum = self.step_fn(batch, lengths, self.grad_accum,
                                                      it % G == 0)
            losses = losses + loss
            n_tokens = n_tokens + toks
            steps += 1
            mx.eval(self.state, losses, n_tokens, self.grad_accum)
            if cfg.clear_cache_threshold and mx.get_cache_memory() > cfg.clear_cache_threshold:
                mx.clear_cache()
            train_time += time.perf_counter() - tic
            if it % cfg.steps_per_report == 0 or it == cfg.iters:
                # DP: mean loss / total tokens over the ranks
                tl = float(self.dp.sum(losses).item()) / (steps * self.dp.size)
                nt = int(self.dp.sum(n_tokens).item())
                trained += nt
                peak = mx.get_peak_memory() / 1e9
                lr = float(self.optimizer.learning_rate.item())
                rec = {"iteration": it, "train_loss": tl, "learning_rate": lr,
                       "tokens_per_second": nt / train_time, "trained_tokens": trained,
                       "peak_memory_gb": peak, "it_per_second": steps / train_time}
                self.history.append(rec)
                self.log(f"[{_bar(it, cfg.iters)}] Iter {it}/{cfg.iters}: loss {tl:.3f} | "
                         f"lr {lr:.2e} | {rec['it_per_second']:.2f} it/s | "
                         f"{rec['tokens_per_second']:.1f} tok/s | trained {trained} tok | "
                         f"peak {peak:.3f} GB")
                losses, n_tokens, steps, train_time = 0, 0, 0, 0.0
            if cfg.save_every and it % cfg.save_every == 0:
                self.save(it)
                self.log(f"Iter {it}: saved {self.out / f'{it:07d}_adapters.safetensors'}")
        self.save(cfg.iters, final=True)
        self.log(f"Saved final adapter to {self.out / 'adapters.safetensors'}")
        return self.history

    @property
    def mode(self):
        c = self.cfg
        if c.segment_size:
            return (f"segmented (segment size {c.segment_size}"
                    + (f", MLP in {c.mlp_chunk}-token chunks)" if c.mlp_chunk else
                       f", per-token parts in {c.token_chunk}-token chunks)" if c.token_chunk
                       else ")"))
        return "grad checkpoint" if c.grad_checkpoint else "full"


def train(model, cfg: TrainConfig, train_set, valid_set=None, log=print, meta=None):
    t = Trainer(model, cfg, train_set, valid_set, log=log, meta=meta)
    return t.run(), t
