"""Training data: mlx-lm's JSONL formats, tokenisation, batching.

A data directory holds ``train.jsonl`` and optionally ``valid.jsonl`` /
``test.jsonl``; each line is one JSON object in one of mlx-lm's formats (the
first row of a file decides which, as in mlx-lm):

- ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?}`` -
  rendered with the tokenizer's chat template; with prompt masking the offset is
  the length of ``messages[:-1]`` rendered with a generation prompt (when the
  last message is the assistant's).
- ``{"prompt": ..., "completion": ...}`` - a user/assistant chat of the two.
- ``{"text": ...}`` - encoded as is, EOS appended if missing; nothing to mask.

Prompt tokens are masked by default (``mask_prompt=True``; mlx-lm's CLI default
is off, pass ``--no-mask-prompt`` for its behaviour). Rows that are not JSON
objects of the file's format raise :class:`DataError` naming file and line.

Batching mirrors mlx-lm 0.32.2's ``iterate_batches``: examples are ordered by
``len(raw_row)`` - mlx-lm's ``CacheDataset.itemlen`` is the number of keys of
the JSON object, not a token count, so in practice the file order is kept (a
stable sort) - cut into consecutive batches of ``batch_size`` (a short tail is
dropped), batches visited in a ``RandomState.permutation`` order per epoch,
rows truncated at ``max_seq_length`` and right-padded with id 0 to
``min(1 + 32 * ceil(max_len / 32), max_seq_length)`` columns. Our iterator draws
its permutations from a ``numpy.random.RandomState(seed)`` in the order
mlx-lm's trainer draws them from numpy's global state (train epochs and
validation passes share it), and its state can be saved for exact resume.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

FORMATS = ("chat", "completions", "text")
PAD_ID = 0  # mlx-lm pads with zeros whatever the tokenizer's pad token is


class DataError(ValueError):
    """A data file or row that cannot be used for training."""


# --- tokenizer shim ----------------------------------------------------------------

def _ids(out):
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return list(out)


def chat_ids(tok, messages, tools=None, add_generation_prompt=False) -> list[int]:
    kw = {"tools": tools} if tools is not None else {}
    return _ids(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **kw))


def eos_id(tok) -> int:
    e = getattr(tok, "eos_token_id", None)
    if e is None:
        ids = getattr(tok, "eos_token_ids", None)
        if ids:
            e = sorted(ids)[0] if isinstance(ids, set) else list(ids)[0]
    if e is None:
        raise DataError("the tokenizer has no EOS token (needed for text rows)")
    return int(e)


# --- rows ---------------------------------------------------------------------------

def _format_of(row: dict, keys) -> Optional[str]:
    if keys["prompt"] in row and keys["completion"] in row:
        return "completions"
    if keys["chat"] in row:
        return "chat"
    if keys["text"] in row:
        return "text"
    return None


def _check_row(row, fmt, keys, where):
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if fmt == "chat":
        msgs = row.get(keys["chat"])
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: {keys['chat']!r} must be a non-empty list of messages")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                raise DataError(f"{where}: message {j} needs a 'role' (got {m!r:.80})")
            if "content" not in m and "tool_calls" not in m:
                raise DataError(f"{where}: message {j} has no 'content'")
    elif fmt == "completions":
        for k in (keys["prompt"], keys["completion"]):
            if not isinstance(row.get(k), str):
                raise DataError(f"{where}: {k!r} must be a string")
    elif fmt == "text":
        if not isinstance(row.get(keys["text"]), str):
            raise DataError(f"{where}: {keys['text']!r} must be a string")


def read_jsonl(path, keys=None) -> tuple[list[dict], str]:
    """(rows, format) of a JSONL file, every row validated (errors name file:line)."""
    keys = {**DEFAULT_KEYS, **(keys or {})}
    path = Path(path)
    rows, fmt = [], None
    with open(path, "r", encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{ln}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if fmt is None:
                fmt = _format_of(row, keys)
                if fmt is None:
                    raise DataError(
                        f"{where}: unsupported row format (keys {sorted(row)}); expected "
                        f"'{keys['chat']}', '{keys['prompt']}'+'{keys['completion']}' or "
                        f"'{keys['text']}'")
            _check_row(row, fmt, keys, where)
            rows.append((ln, row))
    return rows, fmt


DEFAULT_KEYS = {"chat": "messages", "prompt": "prompt", "completion": "completion", "text": "text"}


@dataclass
class Example:
    tokens: list
    offset: int
    raw_len: int  # number of keys of the raw row (mlx-lm's sort key)
    where: str


class Dataset:
    """Tokenised examples of one JSONL file."""

    def __init__(self, examples: list[Example], fmt: str, path=None):
        self.examples = examples
        self.format = fmt
        self.path = path

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        e = self.examples[i]
        return e.tokens, e.offset

    @property
    def n_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.examples)


def tokenize_row(row: dict, fmt: str, tok, mask_prompt: bool, keys=None, where="") -> Example:
    keys = {**DEFAULT_KEYS, **(keys or {})}
    tools = row.get("tools")
    try:
        if fmt == "chat":
            msgs = row[keys["chat"]]
            tokens = chat_ids(tok, msgs, tools)
            offset = 0
            if mask_prompt:
                gen = msgs[-1].get("role") == "assistant"
                offset = len(chat_ids(tok, msgs[:-1], tools, add_generation_prompt=gen))
        elif fmt == "completions":
            msgs = [{"role": "user", "content": row[keys["prompt"]]},
                    {"role": "assistant", "content": row[keys["completion"]]}]
            tokens = chat_ids(tok, msgs, tools)
            offset = len(chat_ids(tok, msgs[:1], tools, add_generation_prompt=True)) if mask_prompt else 0
        else:
            tokens = list(tok.encode(row[keys["text"]]))
            e = eos_id(tok)
            if not tokens or tokens[-1] != e:
                tokens.append(e)
            offset = 0
    except DataError:
        raise
    except Exception as e:  # template errors, bad content types, ...
        raise DataError(f"{where}: could not tokenize the row ({type(e).__name__}: {e})") from None
    if len(tokens) < 2:
        raise DataError(f"{where}: the row tokenizes to {len(tokens)} token(s); need at least 2")
    return Example(list(map(int, tokens)), int(offset), len(row), where)


def load_dataset(path, tok, mask_prompt: bool = True, keys=None) -> Dataset:
    rows, fmt = read_jsonl(path, keys)
    ex = [tokenize_row(r, fmt, tok, mask_prompt, keys, where=f"{path}:{ln}") for ln, r in rows]
    return Dataset(ex, fmt, path)


def load_data_dir(data_dir, tok, mask_prompt: bool = True, keys=None, need_valid=False):
    """{'train', 'valid', 'test'} -> Dataset or None, from `data_dir/*.jsonl`."""
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"{d}: data directory does not exist")
    out = {}
    for name in ("train", "valid", "test"):
        f = d / f"{name}.jsonl"
        out[name] = load_dataset(f, tok, mask_prompt, keys) if f.exists() else None
    if out["train"] is None or len(out["train"]) == 0:
        raise DataError(f"{d}: train.jsonl is missing or empty")
    if need_valid and (out["valid"] is None or len(out["valid"]) == 0):
        raise DataError(f"{d}: valid.jsonl is missing or empty")
    return out


# --- batches -----------------------------------------------------------------------

def pad_width(max_len: int, max_seq_length: int, pad_to: int = 32) -> int:
    return min(1 + pad_to * ((max_len + pad_to - 1) // pad_to), max_seq_length)


def make_batch(rows: list, max_seq_length: int, warn=True):
    """(ids [B, W] int32, lengths [B, 2] = (offset, length)) from (tokens, offset) rows."""
    lengths = [len(t) for t, _ in rows]
    if warn and max(lengths) > max_seq_length:
        warnings.warn(f"some sequences are longer than {max_seq_length} tokens (longest "
                      f"{max(lengths)}); they are truncated", stacklevel=2)
    W = pad_width(max(lengths), max_seq_length)
    arr = np.full((len(rows), W), PAD_ID, np.int32)
    out_len = []
    for j, (t, off) in enumerate(rows):
        n = min(len(t), max_seq_length)
        arr[j, :n] = t[:n]
        out_len.append((off, n))
    return mx.array(arr), mx.array(out_len)


class BatchIterator:
    """mlx-lm's iterate_batches with explicit, saveable state."""

    def __init__(self, dataset: Dataset, batch_size: int, max_seq_length: int,
                 rng: np.random.RandomState, loop: bool = True):
        if len(dataset) < batch_size:
            raise DataError(f"{dataset.path}: the dataset has {len(dataset)} examples, fewer "
                            f"than batch_size={batch_size}")
        self.ds, self.bs, self.max_len, self.rng, self.loop = (
            dataset, batch_size, max_seq_length, rng, loop)
        order = sorted(range(len(dataset)), key=lambda i: dataset.examples[i].raw_len)
        self.batches = [order[i:i + batch_size]
                        for i in range(0, len(order) - batch_size + 1, batch_size)]
        self.perm, self.pos, self.epoch = None, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.perm is None or self.pos >= len(self.perm):
            if self.perm is not None and not self.loop:
                raise StopIteration
            if self.perm is not None:
                self.epoch += 1
            self.perm, self.pos = self.rng.permutation(len(self.batches)), 0
        idx = self.batches[self.perm[self.pos]]
        self.pos += 1
        return make_batch([self.ds[j] for j in idx], self.max_len)

    def state(self) -> dict:
        return {"perm": None if self.perm is None else self.perm.tolist(), "pos": self.pos,
                "epoch": self.epoch}

    def load_state(self, st: dict):
        self.perm = None if st["perm"] is None else np.array(st["perm"])
        self.pos, self.epoch = st["pos"], st["epoch"]


def rng_state(rng: np.random.RandomState) -> list:
    name, keys, pos, has_gauss, cached = rng.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def set_rng_state(rng: np.random.RandomState, st: list):
    rng.set_state((st[0], np.array(st[1], dtype=np.uint32), st[2], st[3], st[4]))
