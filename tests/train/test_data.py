"""train.data: formats, prompt masking, errors, and mlx-lm's batching/shuffling."""

import json
import types

import mlx.core as mx
import numpy as np
import pytest

from engine.text.tokenizer import load_tokenizer
from parity.fixtures.models import ensure_fixture
from tests.train.helpers import write_upper_data
from train.data import (BatchIterator, DataError, load_data_dir, load_dataset, make_batch,
                        pad_width, read_jsonl)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_fixture("qwen3"))


def _ref_dataset(path, tok_dir, fmt_dir, mask_prompt):
    import mlx_lm
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset as ref_load
    _, rt = mlx_lm.load(str(tok_dir))
    args = types.SimpleNamespace(data=str(fmt_dir), train=True, test=False, mask_prompt=mask_prompt)
    tr, va, _ = ref_load(args, rt)
    return CacheDataset(tr), CacheDataset(va)


# mlx-lm refuses prompt masking for text rows (we give them offset 0)
CASES = [(f, m) for f in ("messages", "completions", "text") for m in (True, False)
         if not (f == "text" and m)]


@pytest.mark.parity
@pytest.mark.parametrize("fmt,mask_prompt", CASES)
@pytest.mark.parametrize("family", ["qwen3", "gemma4_text", "llama"])
def test_tokens_and_offsets_equal_mlx_lm(family, fmt, mask_prompt, tmp_path):
    p = ensure_fixture(family)
    d = write_upper_data(tmp_path, n_train=6, n_valid=4, fmt=fmt)
    ours = load_data_dir(d, load_tokenizer(p), mask_prompt=mask_prompt)["train"]
    ref, _ = _ref_dataset(d / "train.jsonl", p, d, mask_prompt)
    assert len(ours) == len(ref)
    for i in range(len(ref)):
        toks, off = ref[i]
        assert (ours[i][0], ours[i][1]) == (list(toks), off), i
    if mask_prompt:
        assert all(0 < ours[i][1] < len(ours[i][0]) for i in range(len(ours)))


@pytest.mark.parity
@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("max_seq_length", [2048, 20])
def test_batches_equal_iterate_batches(seed, max_seq_length, tok, tmp_path):
    """Same batches, padding, truncation and epoch-by-epoch shuffling as
    mlx-lm's iterate_batches over the CacheDataset its trainer builds."""
    from mlx_lm.tuner.trainer import iterate_batches
    p = ensure_fixture("qwen3")
    d = write_upper_data(tmp_path, n_train=10, n_valid=4)
    ours = load_data_dir(d, load_tokenizer(p))["train"]
    ref, _ = _ref_dataset(d / "train.jsonl", p, d, True)
    np.random.seed(seed)
    ref_it = iterate_batches(ref, 3, max_seq_length, loop=True)
    our_it = BatchIterator(ours, 3, max_seq_length, np.random.RandomState(seed))
    for _ in range(7):  # > 2 epochs of 3 batches (the 10th row is dropped)
        (rb, rl), (ob, ol) = next(ref_it), next(our_it)
        assert rb.shape == ob.shape and mx.array_equal(rb, ob).item()
        assert mx.array_equal(rl, ol).item()


def test_padding_width_and_lengths():
    assert pad_width(5, 2048) == 33 and pad_width(32, 2048) == 33 and pad_width(33, 2048) == 65
    assert pad_width(100, 50) == 50
    with pytest.warns(UserWarning, match="truncated"):
        ids, lengths = make_batch([(list(range(1, 60)), 3), ([7, 8, 9], 1)], 40)
    assert ids.shape == (2, 40)
    assert lengths.tolist() == [[3, 40], [1, 3]]
    assert ids[1, 3:].tolist() == [0] * 37  # right padding with id 0


def _write(tmp_path, lines, name="train.jsonl"):
    f = tmp_path / name
    f.write_text("\n".join(lines) + "\n")
    return f


@pytest.mark.parametrize("lines,match", [
    (['{"text": "a b"}', '{"text": "c"', '{"text": "d"}'], r"train\.jsonl:2: invalid JSON"),
    (['{"text": "a"}', '[1, 2]'], r"train\.jsonl:2: expected a JSON object"),
    (['{"foo": 1}'], r"train\.jsonl:1: unsupported row format"),
    (['{"messages": [{"role": "user", "content": "hi"}]}', '{"text": "x"}'],
     r"train\.jsonl:2: 'messages' must be a non-empty list"),
    (['{"messages": [{"content": "hi"}]}'], r"train\.jsonl:1: message 0 needs a 'role'"),
    (['{"prompt": "a", "completion": 3}'], r"train\.jsonl:1: 'completion' must be a string"),
    (['{"text": "ok"}', '', '{"text": null}'], r"train\.jsonl:3: 'text' must be a string"),
])
def test_bad_rows_name_file_and_line(tmp_path, lines, match):
    f = _write(tmp_path, lines)
    with pytest.raises(DataError, match=match):
        read_jsonl(f)


def test_too_short_row_names_line(tmp_path, tok):
    f = _write(tmp_path, [json.dumps({"text": "hello there"}), json.dumps({"text": ""})])
    with pytest.raises(DataError, match=r"train\.jsonl:2: the row tokenizes to 1 token"):
        load_dataset(f, tok)


def test_text_rows_get_eos_and_no_mask(tmp_path, tok):
    f = _write(tmp_path, [json.dumps({"text": "hello there"})])
    ds = load_dataset(f, tok, mask_prompt=True)
    toks, off = ds[0]
    assert off == 0 and toks[-1] == tok.eos_token_id


def test_data_dir_errors(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        load_data_dir(tmp_path / "nope", tok)
    with pytest.raises(DataError, match="train.jsonl is missing"):
        load_data_dir(tmp_path, tok)
    write_upper_data(tmp_path, n_train=2, n_valid=1)
    ds = load_data_dir(tmp_path, tok)["train"]
    with pytest.raises(DataError, match="fewer than batch_size=4"):
        BatchIterator(ds, 4, 2048, np.random.RandomState(0))


def test_iterator_state_round_trip(tmp_path, tok):
    write_upper_data(tmp_path, n_train=12, n_valid=2)
    ds = load_data_dir(tmp_path, tok)["train"]
    rng = np.random.RandomState(1)
    a = BatchIterator(ds, 2, 2048, rng)
    for _ in range(8):
        next(a)
    from train.data import rng_state, set_rng_state
    st, rs = a.state(), rng_state(rng)
    want = [next(a)[0] for _ in range(6)]
    rng2 = np.random.RandomState(99)
    set_rng_state(rng2, rs)
    b = BatchIterator(ds, 2, 2048, rng2)
    b.load_state(st)
    got = [next(b)[0] for _ in range(6)]
    assert all(mx.array_equal(x, y).item() for x, y in zip(want, got))
