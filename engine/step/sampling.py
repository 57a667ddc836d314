"""Samplers and logits processors, bit-identical to mlx-lm 0.32.2.

A *sampler* maps log-probabilities ``[B, V]`` to tokens ``[B]``. A *logits
processor* maps ``(tokens, logits [B, V]) -> logits [B, V]`` where ``tokens`` is
the 1-D token history (prompt + generated so far). The token loop applies the
processors to the raw logits, normalises with ``logits - logsumexp(logits)``
and hands the result to the sampler (see ``engine.step.stepper.generate_step``).

Parity contract (proved in ``tests/engine/test_sampling.py`` against live
mlx-lm with ``mx.array_equal``): for the same ``mx.random.seed`` and settings,
``make_sampler(...)`` returns the same tokens as mlx-lm's and leaves the global
PRNG in the same state after every call, so whole sequences of calls match;
``make_logits_processors(...)`` returns the same logits. What that takes:

- the filter chain runs on the *untempered* log-probs in the fixed order
  top-p, min-p, XTC, top-k; temperature is applied last, as
  ``logits * (1.0 / temp)`` (not ``logits / temp``: the bits differ);
- every stage is an ``mx.compile``'d function that threads the global PRNG
  state, so fused kernels (and their rounding) are the same as the oracle's;
- top-k and ``min_tokens_to_keep`` break ties with ``argpartition`` exactly as
  the oracle does, which matters for bf16 logits where ties are common;
- XTC draws one uniform per call (one coin for the whole batch), then the
  categorical draws its own key: two PRNG splits per step, in that order;
- the frequency penalty subtracts once per occurrence with a scatter-add
  (``p`` subtracted ``n`` times, not ``n * p``: the bits differ).

Where we differ from mlx-lm, on purpose:

- bad settings raise ``ValueError`` when the sampler/processors are made
  (mlx-lm accepts e.g. a negative temperature, which samples the *least*
  likely token, or silently ignores ``top_p`` outside ``(0, 1)``);
- ``top_k >= vocab size`` keeps every token (mlx-lm raises at the first step);
- our processors never modify their input array (mlx-lm's repetition and
  presence penalties assign into the caller's ``logits`` in place);
- ``logit_bias`` accepts decimal-string keys (as JSON bodies carry them);
- a ``*_context_size`` of ``None`` means the whole history (mlx-lm crashes;
  and its ``0`` silently means the whole history too, which we reject).

Per-call keys: every sampler also accepts ``sampler(logprobs, key=k)``. With
``key=None`` (the default) it draws from the global PRNG exactly like mlx-lm.
With a key it consumes no global state: ``k`` is a single PRNG key (shape
``[2]``, from ``mx.random.key``) used for the whole batch, or ``[B, 2]`` keys,
one per row, in which case row ``e`` is sampled as
``sampler(logprobs[e:e+1], key=k[e])`` would sample it, independent of what
else is in the batch (what a batched server needs for per-request seeds).
With XTC active a key is split in two, ``(xtc_key, categorical_key)``.
"""

from __future__ import annotations

import math
from functools import partial
from numbers import Integral, Real
from typing import Callable, Dict, List, Optional, Sequence, Union

import mlx.core as mx

Sampler = Callable[..., mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

_NEG_INF = -float("inf")

__all__ = [
    "Sampler",
    "LogitsProcessor",
    "make_sampler",
    "make_logits_processors",
    "greedy",
    "apply_top_p",
    "apply_min_p",
    "apply_top_k",
    "apply_xtc",
    "categorical",
]


# ----------------------------------------------------------------- validation

def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _check_real(name: str, value, lo: Optional[float] = None, hi: Optional[float] = None,
                interval: str = "") -> float:
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return value


def _check_int(name: str, value, lo: int) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    return int(value)


# ------------------------------------------------------------ sampling stages
#
# Each stage is compiled with the global PRNG state as an implicit input and
# output, the way the oracle compiles its stages, so the traced graphs (and the
# fused kernels' rounding) are the same. Python scalars are compile-time
# constants: a new value retraces once.

_compile_rng = partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)


def greedy(logprobs: mx.array, key: Optional[mx.array] = None) -> mx.array:
    """argmax over the last axis (first maximum on ties); ignores ``key``."""
    return mx.argmax(logprobs, axis=-1)


@_compile_rng
def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    # Keep the smallest high-probability set whose mass reaches top_p of the
    # total: walk the ascending sort and count the tokens that can be dropped
    # because the mass strictly above them already reaches the target.
    ascending = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ascending.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = above[..., :1] + probs[..., :1]
    n_drop = (above >= top_p * total).sum(axis=-1, keepdims=True)
    cutoff = mx.take_along_axis(ascending, n_drop, axis=-1)
    return mx.where(logprobs < cutoff, _NEG_INF, logprobs)


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Nucleus filter: tokens outside the top-``top_p`` mass become -inf."""
    return _top_p(logprobs, top_p)


@_compile_rng
def _min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int) -> mx.array:
    best = mx.max(logprobs, axis=-1, keepdims=True)
    drop = logprobs < best + math.log(min_p)
    if min_tokens_to_keep > 1:
        keep = mx.argpartition(logprobs, kth=-min_tokens_to_keep, axis=-1)
        keep = keep[..., -min_tokens_to_keep:]
        drop = mx.put_along_axis(drop, keep, mx.array(False), axis=-1)
    return mx.where(drop, _NEG_INF, logprobs)


def apply_min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """Drop tokens with p < min_p * p_max, always keeping the top ``min_tokens_to_keep``."""
    return _min_p(logprobs, min_p, min_tokens_to_keep)


@_compile_rng
def _top_k(logprobs: mx.array, top_k: int) -> mx.array:
    rest = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, rest, mx.array(_NEG_INF, logprobs.dtype), axis=-1)


def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the ``top_k`` most likely tokens (a no-op when top_k >= vocab size)."""
    if top_k >= logprobs.shape[-1]:
        return logprobs
    return _top_k(logprobs, top_k)


def _xtc_mask(logprobs, threshold, special):
    # Among the tokens above the threshold, all but the least likely one go.
    probs = mx.softmax(logprobs, -1)
    floor = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = probs > floor
    if special:
        mask[..., special] = False
    return mask


@_compile_rng
def _xtc_global(logprobs, probability, threshold, special):
    mask = _xtc_mask(logprobs, threshold, special)
    coin = mx.random.uniform(0, 1)
    return mx.where(coin > probability, logprobs, mx.where(mask, -mx.inf, logprobs))


@_compile_rng
def _xtc_keyed(logprobs, key, probability, threshold, special):
    mask = _xtc_mask(logprobs, threshold, special)
    coin = mx.random.uniform(0, 1, key=key)
    return mx.where(coin > probability, logprobs, mx.where(mask, -mx.inf, logprobs))


def apply_xtc(logprobs: mx.array, probability: float, threshold: float,
              special_tokens: Sequence[int] = (), key: Optional[mx.array] = None) -> mx.array:
    """Exclude Top Choices: with probability ``probability`` (one coin per call),
    drop every token above ``threshold`` except the least likely of them."""
    special = list(special_tokens)
    if key is None:
        return _xtc_global(logprobs, probability, threshold, special)
    return _xtc_keyed(logprobs, key, probability, threshold, special)


@_compile_rng
def _categorical_global(logits: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(logits * (1.0 / temp))


@_compile_rng
def _categorical_keyed(logits: mx.array, key: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(logits * (1.0 / temp), key=key)


def categorical(logits: mx.array, temp: float, key: Optional[mx.array] = None) -> mx.array:
    """Sample from softmax(logits / temp) (Gumbel-max; one PRNG split per call)."""
    if key is None:
        return _categorical_global(logits, temp)
    return _categorical_keyed(logits, key, temp)


# -------------------------------------------------------------------- sampler

def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[Sequence[int]] = None,
) -> Sampler:
    """A sampler ``fn(logprobs [B, V], key=None) -> tokens [B]`` (uint32; int32 when greedy).

    temp: 0 -> argmax (all filters ignored, as in mlx-lm), else sample at that
        temperature. Must be >= 0.
    top_p: nucleus mass in [0, 1]; 0 or 1 is off.
    min_p: in [0, 1]; 0 is off. min_tokens_to_keep (>= 1) survive it.
    top_k: integer >= 0; 0 is off; >= vocab size keeps everything.
    xtc_probability in [0, 1] (0 is off), xtc_threshold in [0, 0.5],
    xtc_special_tokens: ids XTC never removes (e.g. EOS ids, newline).
    """
    temp = _check_real("temp", temp, lo=0.0, interval="[0, inf)")
    top_p = _check_real("top_p", top_p, 0.0, 1.0, "[0, 1]")
    min_p = _check_real("min_p", min_p, 0.0, 1.0, "[0, 1]")
    min_tokens_to_keep = _check_int("min_tokens_to_keep", min_tokens_to_keep, 1)
    top_k = _check_int("top_k", top_k, 0)
    xtc_probability = _check_real("xtc_probability", xtc_probability, 0.0, 1.0, "[0, 1]")
    xtc_threshold = _check_real("xtc_threshold", xtc_threshold, 0.0, 0.5, "[0, 0.5]")
    special = [] if xtc_special_tokens is None else list(xtc_special_tokens)
    for t in special:
        if not _is_int(t) or t < 0:
            raise ValueError(f"xtc_special_tokens must be non-negative token ids, got {t!r}")
    special = [int(t) for t in special]

    if temp == 0:
        return greedy

    use_top_p = 0.0 < top_p < 1.0
    use_min_p = min_p != 0.0
    use_xtc = xtc_probability > 0.0
    use_top_k = top_k > 0

    def run(logprobs: mx.array, key: Optional[mx.array]) -> mx.array:
        xtc_key = cat_key = key
        if key is not None and use_xtc:
            xtc_key, cat_key = mx.random.split(key)
        if use_top_p:
            logprobs = _top_p(logprobs, top_p)
        if use_min_p:
            logprobs = _min_p(logprobs, min_p, min_tokens_to_keep)
        if use_xtc:
            logprobs = apply_xtc(logprobs, xtc_probability, xtc_threshold, special, key=xtc_key)
        if use_top_k:
            logprobs = apply_top_k(logprobs, top_k)
        return categorical(logprobs, temp, key=cat_key)

    def sampler(logprobs: mx.array, key: Optional[mx.array] = None) -> mx.array:
        if key is None or key.ndim == 1:
            return run(logprobs, key)
        if key.ndim != 2 or key.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"key must be one PRNG key [2] or one per row [{logprobs.shape[0]}, 2], "
                f"got shape {tuple(key.shape)}")
        return mx.concatenate([run(logprobs[e:e + 1], key[e]) for e in range(key.shape[0])])

    sampler.settings = dict(temp=temp, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
                            top_k=top_k, xtc_probability=xtc_probability,
                            xtc_threshold=xtc_threshold, xtc_special_tokens=special)
    return sampler


# ---------------------------------------------------------- logits processors

def _window(tokens, context_size: Optional[int]) -> Optional[mx.array]:
    if not isinstance(tokens, mx.array):
        tokens = mx.array(list(tokens), dtype=mx.int32)
    if tokens.size == 0:
        return None
    return tokens if context_size is None else tokens[-context_size:]


def _rows(idx: mx.array, logits: mx.array) -> mx.array:
    return mx.broadcast_to(idx[None], (logits.shape[0], idx.size))


def _repetition(penalty: float, context_size: Optional[int]) -> LogitsProcessor:
    def repetition_penalty(tokens, logits):
        ctx = _window(tokens, context_size)
        if ctx is None:
            return logits
        idx = _rows(ctx, logits)
        seen = mx.take_along_axis(logits, idx, axis=-1)
        seen = mx.where(seen < 0, seen * penalty, seen / penalty)
        return mx.put_along_axis(logits, idx, seen, axis=-1)

    return repetition_penalty


def _presence(penalty: float, context_size: Optional[int]) -> LogitsProcessor:
    def presence_penalty(tokens, logits):
        ctx = _window(tokens, context_size)
        if ctx is None:
            return logits
        idx = _rows(ctx, logits)
        # a repeated id is written twice with the same value: once per distinct token
        seen = mx.take_along_axis(logits, idx, axis=-1) - penalty
        return mx.put_along_axis(logits, idx, seen, axis=-1)

    return presence_penalty


def _frequency(penalty: float, context_size: Optional[int]) -> LogitsProcessor:
    def frequency_penalty(tokens, logits):
        ctx = _window(tokens, context_size)
        if ctx is None:
            return logits
        return logits.at[:, ctx].subtract(penalty)

    return frequency_penalty


def _bias(logit_bias: Dict[int, float]) -> LogitsProcessor:
    ids, vals = [], []
    for k, v in logit_bias.items():
        if isinstance(k, str) and k.strip().lstrip("+").isdigit():
            k = int(k)
        if not _is_int(k) or k < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {k!r}")
        ids.append(int(k))
        vals.append(_check_real(f"logit_bias[{k}]", v))
    top = max(ids)
    idx = mx.array(ids)
    add = mx.array(vals, dtype=mx.float32)

    def logit_bias_processor(tokens, logits):
        if top >= logits.shape[-1]:
            raise ValueError(f"logit_bias token id {top} is outside the vocabulary "
                             f"(size {logits.shape[-1]})")
        return logits.at[:, idx].add(add)

    # what the batch scheduler needs to apply many rows' biases in one scatter
    # (the same `at[].add` per element, so the same values)
    logit_bias_processor.bias = (ids, idx, add, top)
    return logit_bias_processor


def _context(name: str, value) -> Optional[int]:
    if value is None:
        return None
    return _check_int(name, value, 1)


def make_logits_processors(
    logit_bias: Optional[Dict[Union[int, str], float]] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: Optional[int] = 20,
    presence_penalty: Optional[float] = None,
    presence_context_size: Optional[int] = 20,
    frequency_penalty: Optional[float] = None,
    frequency_context_size: Optional[int] = 20,
) -> List[LogitsProcessor]:
    """Processors ``fn(tokens [T], logits [B, V]) -> logits``, applied in list order:
    logit bias, repetition, presence, frequency (mlx-lm's order).

    logit_bias: {token id: additive bias}; empty/None is off.
    repetition_penalty: > 0, sign-aware multiplicative (CTRL): logits of tokens
        in the last ``repetition_context_size`` are divided by it if >= 0 and
        multiplied if < 0. None or 0 is off.
    presence_penalty: subtracted once from each distinct token in the window.
    frequency_penalty: subtracted once per occurrence in the window.
    None or 0 is off for each; context sizes are >= 1, or None for the whole
    history. Each processor returns a new array (the input is left alone).
    """
    procs: List[LogitsProcessor] = []
    if logit_bias:
        if not isinstance(logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to float, got {type(logit_bias).__name__}")
        procs.append(_bias(logit_bias))

    rep_n = _context("repetition_context_size", repetition_context_size)
    pres_n = _context("presence_context_size", presence_context_size)
    freq_n = _context("frequency_context_size", frequency_context_size)

    if repetition_penalty is not None:
        _check_real("repetition_penalty", repetition_penalty, lo=0.0, interval="[0, inf)")
        if repetition_penalty != 0:
            procs.append(_repetition(repetition_penalty, rep_n))
    if presence_penalty is not None:
        _check_real("presence_penalty", presence_penalty)
        if presence_penalty != 0:
            procs.append(_presence(presence_penalty, pres_n))
    if frequency_penalty is not None:
        _check_real("frequency_penalty", frequency_penalty)
        if frequency_penalty != 0:
            procs.append(_frequency(frequency_penalty, freq_n))
    for p in procs:          # (pure functions of (tokens, logits): speculation may call them
        p.pure = True        # at a row's later verify positions, engine.step.batch_lookup)
    return procs
