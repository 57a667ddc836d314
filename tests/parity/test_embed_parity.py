"""L1 for embeddings: `engine.embed` on our model code against the oracles, bit for bit.

- The hidden states it pools are mlx-lm's `model.model(ids)` (the backbone after its final
  norm), and each vector equals the pooling done by hand on mlx-lm's hidden states
  (last token / mean over the tokens, in float32, then L2-normalised), for qwen3 and llama
  at float32 and bfloat16.
- Against mlx-embeddings 0.1.0's qwen3 embedder (its own forward, attention mask,
  last-token pooling and normalisation) on the same tiny weights, in a padded batch.
  mlx-embeddings imports mlx-vlm, which is not among the test extras: install both with
  `pip install --no-deps mlx-embeddings==0.1.0 mlx-vlm` to run it.
- Padding never changes a row: each input alone equals the same input batched with longer
  ones (right-padded), and a batch split in several forwards equals one forward (exact on
  the CPU: the attention is causal, pads come after the real tokens, pooling reads only a
  row's own tokens).
"""

import glob
import json

import mlx.core as mx
import numpy as np
import pytest

from engine import EmbeddingInputError, checkpoint_pooling, embed
from engine.embeddings import MAX_INPUTS, hidden_states, l2_normalize
from engine.loader import load
from parity.fixtures.models import ensure_fixture
from parity.oracles import mlx_lm_oracle

pytestmark = pytest.mark.parity

CASES = [(f, d) for f in ("qwen3", "llama") for d in ("float32", "bfloat16")]
# token lists of several lengths (ids < 1024, the fixtures' vocabulary)
SEQS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42, 43, 44, 45],
        [900]]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def pair(request):
    path = str(ensure_fixture(*request.param))
    ours, tok = load(path)
    ref, _ = mlx_lm_oracle.load(path)
    return ours, tok, ref, path


def _by_hand(ref, ids, pooling):
    h = ref.model(mx.array([ids]))[0]          # mlx-lm's backbone: hidden states after the norm
    v = h[-1].astype(mx.float32) if pooling == "last" else mx.mean(h.astype(mx.float32), axis=0)
    return v


def test_hidden_states_are_mlx_lms(pair):
    ours, _, ref, _ = pair
    for ids in SEQS:
        x = mx.array([ids])
        assert mx.array_equal(hidden_states(ours, x), ref.model(x)).item()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_equal_pooling_by_hand_on_mlx_lm(pair, pooling):
    ours, tok, ref, _ = pair
    out = embed(ours, tok, SEQS, pooling=pooling)
    assert out.vectors.shape == (len(SEQS), ours.args.hidden_size)
    assert out.vectors.dtype == mx.float32 and out.token_counts == tuple(map(len, SEQS))
    for i, ids in enumerate(SEQS):
        want = l2_normalize(_by_hand(ref, ids, pooling))
        assert mx.array_equal(out.vectors[i], want).item(), (pooling, i)
    raw = embed(ours, tok, SEQS, pooling=pooling, normalize=False)
    for i, ids in enumerate(SEQS):
        assert mx.array_equal(raw.vectors[i], _by_hand(ref, ids, pooling)).item()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_formula_against_float64(pair, pooling):
    """The pooling + normalisation formula itself, recomputed in float64 from the hidden
    states (float32 rounding of a mean and a norm over 64 values: within 1e-6)."""
    ours, tok, ref, _ = pair
    out = np.array(embed(ours, tok, SEQS, pooling=pooling).vectors)
    for i, ids in enumerate(SEQS):
        h = np.array(ref.model(mx.array([ids]))[0].astype(mx.float32), dtype=np.float64)
        v = h[-1] if pooling == "last" else h.mean(axis=0)
        np.testing.assert_allclose(out[i], v / np.linalg.norm(v), rtol=0, atol=1e-6)
        assert abs(np.linalg.norm(out[i]) - 1) < 1e-6


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_padding_never_changes_a_row(pair, pooling):
    ours, tok, _, _ = pair
    padded = embed(ours, tok, SEQS, pooling=pooling, min_fill=0)      # one padded forward
    split = embed(ours, tok, SEQS, pooling=pooling, min_fill=0, batch_tokens=12)
    default = embed(ours, tok, SEQS + [s[:-1] for s in SEQS if len(s) > 1], pooling=pooling)
    for i, ids in enumerate(SEQS):
        alone = embed(ours, tok, [ids], pooling=pooling).vectors[0]
        assert mx.array_equal(padded.vectors[i], alone).item(), (pooling, i)
        assert mx.array_equal(split.vectors[i], alone).item(), (pooling, i)
        assert mx.array_equal(default.vectors[i], alone).item(), (pooling, i)


def test_groups_bound_the_padding():
    from engine.embeddings import group_inputs
    lengths = [100, 10, 80, 76, 74, 9, 100]
    assert group_inputs(lengths, 8192, 0.75) == [[0, 6, 2, 3], [4], [1, 5]]
    assert group_inputs(lengths, 8192, 0) == [[0, 6, 2, 3, 4, 1, 5]]
    assert group_inputs(lengths, 250, 0) == [[0, 6], [2, 3, 4], [1, 5]]


def test_text_is_tokenized_with_the_tokenizers_defaults(pair):
    ours, tok, ref, _ = pair
    texts = ["hello world", "a longer sentence to embed here"]
    out = embed(ours, tok, texts)
    for i, t in enumerate(texts):
        ids = list(tok.encode(t))
        assert out.token_counts[i] == len(ids)
        assert mx.array_equal(out.vectors[i], l2_normalize(_by_hand(ref, ids, "last"))).item()
    assert mx.array_equal(embed(ours, tok, texts[0]).vectors, out.vectors[:1]).item()


def test_dimensions_truncate_then_renormalise(pair):
    ours, tok, _, _ = pair
    raw = embed(ours, tok, SEQS, normalize=False).vectors
    for d in (1, 8, ours.args.hidden_size):
        out = embed(ours, tok, SEQS, dimensions=d).vectors
        assert out.shape == (len(SEQS), d)
        assert mx.array_equal(out, l2_normalize(raw[:, :d])).item()
    for bad in (0, -1, ours.args.hidden_size + 1, 2.5, True):
        with pytest.raises(EmbeddingInputError, match="dimensions"):
            embed(ours, tok, SEQS, dimensions=bad)


@pytest.mark.parametrize("inputs,needle", [
    ([], "input is empty"), ("", "input is an empty string"),
    (["a", ""], r"input\[1\] is an empty string"), ([[]], r"input\[0\] has no tokens"),
    ([[1, 2], [3, 5000]], r"input\[1\]: token id 5000 is outside the vocabulary"),
    ([-1], "token id -1 is outside"), ([["a"]], r"input\[0\] must be a string or a list"),
    ([1, "a"], r"input\[0\] must be"), (5, "input must be a string"),
    ([True], r"input\[0\] must be"), (["x"] * (MAX_INPUTS + 1), "the limit is 2048"),
])
def test_bad_input_is_a_value_error_naming_it(pair, inputs, needle):
    ours, tok, _, _ = pair
    with pytest.raises(ValueError, match=needle):
        embed(ours, tok, inputs)


def test_too_long_for_the_context(pair):
    ours, tok, _, _ = pair
    with pytest.raises(EmbeddingInputError, match=r"input\[1\] has 5 tokens; this model's "
                                                   r"context is 4 tokens") as e:
        embed(ours, tok, [[1, 2], [1, 2, 3, 4, 5]], max_tokens=4)
    assert e.value.param == "input[1]"
    n = ours.args.max_position_embeddings
    with pytest.raises(EmbeddingInputError, match=f"context is {n} tokens"):
        embed(ours, tok, [[7] * (n + 1)])
    with pytest.raises(ValueError, match="pooling must be one of"):
        embed(ours, tok, "hi", pooling="cls")


def test_checkpoint_pooling(tmp_path):
    assert checkpoint_pooling(tmp_path) is None
    (tmp_path / "1_Pooling").mkdir()
    f = tmp_path / "1_Pooling" / "config.json"
    f.write_text(json.dumps({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    assert checkpoint_pooling(tmp_path) == "last"
    f.write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert checkpoint_pooling(tmp_path) == "mean"
    f.write_text("{not json")
    assert checkpoint_pooling(tmp_path) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_equals_mlx_embeddings(dtype):
    # the oracle: scripts/test.sh installs mlx-embeddings 0.1.0 (and mlx-vlm, without deps)
    from mlx_embeddings.models import qwen3 as E
    from mlx_embeddings.models.base import normalize_embeddings

    path = ensure_fixture("qwen3", dtype)
    oracle = E.Model(E.ModelArgs.from_dict(json.loads((path / "config.json").read_text())))
    weights = {}
    for f in glob.glob(str(path / "*.safetensors")):
        weights.update(mx.load(f))
    oracle.load_weights(list(oracle.sanitize(weights).items()), strict=False)
    width = max(map(len, SEQS))
    ids = mx.array([s + [0] * (width - len(s)) for s in SEQS])
    mask = mx.array([[1] * len(s) + [0] * (width - len(s)) for s in SEQS])
    theirs = oracle(ids, attention_mask=mask)
    ours, tok = load(str(path))
    h = hidden_states(ours, ids)
    for i, s in enumerate(SEQS):      # real positions of the padded batch: identical
        assert mx.array_equal(h[i, :len(s)], theirs.last_hidden_state[i, :len(s)]).item()
    out = embed(ours, tok, SEQS).vectors
    pooled = E.last_token_pool(theirs.last_hidden_state, mask)
    # mlx-embeddings normalises in the model's dtype; ours in float32 (the same at float32)
    assert mx.array_equal(out, normalize_embeddings(pooled.astype(mx.float32))).item()
    if dtype == "float32":
        assert mx.array_equal(out, theirs.text_embeds).item()
