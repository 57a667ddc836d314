"""Text embeddings from a decoder: the final hidden states (after the last norm, before
the LM head), pooled per input, L2-normalised, optionally truncated (Matryoshka).

    out = embed(model, tokenizer, ["a query", "a document"], pooling="last")
    out.vectors          # mx.array (n, d) float32, one row per input, in input order
    out.prompt_tokens    # tokens read, all inputs together

Pooling: ``last`` takes the hidden state of each input's last token (Qwen3-Embedding and
other decoder embedders: their tokenizer appends the end-of-text token that carries the
summary); ``mean`` averages the hidden states of an input's tokens (an opt-in for any
decoder). Inputs are tokenized as the checkpoint's tokenizer does by default (its
special tokens included) or given as token ids.

Batching: inputs are sorted by length and run in groups of at most ``batch_tokens``
padded tokens, right-padded, each row at least ``min_fill`` of its group's longest (at most
a quarter of a group is padding by default). The attention is causal, so a real token never attends to
a pad after it, and pooling reads only real positions (each row's own slice): an input's
vector does not depend on what it is batched with (tests/engine/test_embed.py checks it
bit for bit on the CPU).

Bad input raises `EmbeddingInputError` (a ValueError) whose message names the input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import mlx.core as mx

from .step.request import model_context, model_vocab_size

POOLINGS = ("last", "mean")
MAX_INPUTS = 2048          # inputs per call (OpenAI's limit per request)
MAX_TOTAL_TOKENS = 300_000  # tokens of all inputs together per call (OpenAI's limit)
BATCH_TOKENS = 8192        # padded tokens per forward
MIN_FILL = 0.75            # a row is batched with longer ones down to 3/4 of their length
NORM_EPS = 1e-9

Inputs = Union[str, Sequence[str], Sequence[int], Sequence[Sequence[int]]]


class EmbeddingInputError(ValueError):
    """The input cannot be embedded; `param` is the input at fault (``input[2]``)."""

    def __init__(self, message: str, param: str = "input"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Embeddings:
    vectors: mx.array              # (n, d) float32
    token_counts: tuple            # tokens of each input
    pooling: str

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _items(inputs: Inputs) -> list:
    """The list of inputs (a lone string or a lone list of ids is one input)."""
    if isinstance(inputs, str):
        return [inputs]
    if not isinstance(inputs, (list, tuple)):
        raise EmbeddingInputError("input must be a string, a list of strings, a list of token "
                                  "ids or a list of lists of token ids")
    if not inputs:
        raise EmbeddingInputError("input is empty: give at least one string or token list")
    if all(_is_id(t) for t in inputs):
        return [list(inputs)]
    return list(inputs)


def tokenize(tokenizer, inputs: Inputs, vocab_size: Optional[int] = None,
             max_tokens: Optional[int] = None) -> list:
    """Token ids of each input, checked: not empty, in the vocabulary, within `max_tokens`."""
    items = _items(inputs)
    if len(items) > MAX_INPUTS:
        raise EmbeddingInputError(f"input has {len(items)} items; the limit is {MAX_INPUTS}")
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]" if len(items) > 1 or not isinstance(inputs, str) else "input"
        if isinstance(item, str):
            if not item:
                raise EmbeddingInputError(f"{where} is an empty string", where)
            ids = list(tokenizer.encode(item))
        elif isinstance(item, (list, tuple)) and all(_is_id(t) for t in item):
            ids = list(item)
        else:
            raise EmbeddingInputError(f"{where} must be a string or a list of token ids "
                                      f"(integers)", where)
        if not ids:
            raise EmbeddingInputError(f"{where} has no tokens", where)
        if vocab_size:
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise EmbeddingInputError(f"{where}: token id {bad} is outside the vocabulary "
                                          f"(size {vocab_size})", where)
        if max_tokens and len(ids) > max_tokens:
            raise EmbeddingInputError(f"{where} has {len(ids)} tokens; this model's context is "
                                      f"{max_tokens} tokens", where)
        out.append(ids)
    return out


def hidden_states(model, ids: mx.array) -> mx.array:
    """(B, L, hidden) states after the final norm (causal attention, no cache)."""
    h, ctx = model.begin(ids)
    for i in range(len(model.layers)):
        h = model.layer_step(i, h, ctx)
    decoder = getattr(model, "language_model", model)
    return decoder.model.norm(h)


def pool(h: mx.array, length: int, pooling: str) -> mx.array:
    """One row's vector (float32) from its (L, hidden) states, `length` of them real."""
    if pooling == "last":
        return h[length - 1].astype(mx.float32)
    return mx.mean(h[:length].astype(mx.float32), axis=0)


def l2_normalize(v: mx.array) -> mx.array:
    return v / mx.maximum(mx.linalg.norm(v, ord=2, axis=-1, keepdims=True), NORM_EPS)


def group_inputs(lengths: list, batch_tokens: int, min_fill: float) -> list:
    """Input indices, longest first, in groups of at most `batch_tokens` padded tokens whose
    rows are each at least `min_fill` x the group's longest (padding stays bounded)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, cur = [], []
    for i in order:
        if cur and (lengths[cur[0]] * (len(cur) + 1) > batch_tokens
                    or lengths[i] < min_fill * lengths[cur[0]]):
            groups.append(cur)
            cur = []
        cur.append(i)
    return groups + [cur] if cur else groups


class EmbedJob:
    """An `embed` call in parts: made (the inputs tokenized and checked, then grouped) away
    from the model's thread; `run(i)` computes group i's vectors (one forward of at most
    `batch_tokens` padded tokens, or one input alone where it is longer); `result()` the
    `Embeddings` once every group ran. A server runs one group between two decode steps, so a
    large request never holds the batch for more than one forward."""

    def __init__(self, model, tokenizer, inputs: Inputs, pooling: str = "last",
                 normalize: bool = True, dimensions: Optional[int] = None,
                 max_tokens: Optional[int] = None, batch_tokens: int = BATCH_TOKENS,
                 min_fill: float = MIN_FILL):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        hidden = getattr(getattr(model, "args", None), "hidden_size", None)
        if dimensions is not None and (not _is_id(dimensions) or dimensions < 1 or (
                hidden and dimensions > hidden)):
            raise EmbeddingInputError(f"dimensions must be an integer from 1 to {hidden}, not "
                                      f"{dimensions!r}", "dimensions")
        self.model, self.pooling, self.normalize, self.dimensions = (model, pooling, normalize,
                                                                     dimensions)
        self.seqs = tokenize(tokenizer, inputs, model_vocab_size(model),
                             max_tokens or model_context(model))
        total = sum(len(s) for s in self.seqs)
        if total > MAX_TOTAL_TOKENS:
            raise EmbeddingInputError(f"the inputs have {total:,} tokens together; the limit "
                                      f"is {MAX_TOTAL_TOKENS:,} a request")
        self.groups = group_inputs([len(s) for s in self.seqs], max(1, batch_tokens), min_fill)
        self.rows: list = [None] * len(self.seqs)

    def run(self, i: int) -> None:
        group, seqs = self.groups[i], self.seqs
        width = len(seqs[group[0]])
        batch = mx.array([seqs[j] + [0] * (width - len(seqs[j])) for j in group])
        h = hidden_states(self.model, batch)
        for r, j in enumerate(group):
            self.rows[j] = pool(h[r], len(seqs[j]), self.pooling)
        mx.eval([self.rows[j] for j in group])

    def result(self) -> Embeddings:
        vectors = mx.stack(self.rows)
        if self.dimensions is not None:
            vectors = vectors[:, :self.dimensions]
        if self.normalize:
            vectors = l2_normalize(vectors)
        mx.eval(vectors)
        return Embeddings(vectors, tuple(len(s) for s in self.seqs), self.pooling)


def embed(model, tokenizer, inputs: Inputs, pooling: str = "last", normalize: bool = True,
          dimensions: Optional[int] = None, max_tokens: Optional[int] = None,
          batch_tokens: int = BATCH_TOKENS, min_fill: float = MIN_FILL) -> Embeddings:
    """Embed `inputs` (see the module docstring); `max_tokens` defaults to the model's
    context; `dimensions` keeps the first d components (then renormalises); `batch_tokens`
    and `min_fill` shape the batches (`min_fill=0`: any lengths together)."""
    job = EmbedJob(model, tokenizer, inputs, pooling, normalize, dimensions, max_tokens,
                   batch_tokens, min_fill)
    for i in range(len(job.groups)):
        job.run(i)
    return job.result()


def checkpoint_pooling(model_dir) -> Optional[str]:
    """The pooling a sentence-transformers checkpoint declares (`1_Pooling/config.json`:
    last-token or mean), or None."""
    try:
        cfg = json.loads((Path(model_dir) / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    return None
