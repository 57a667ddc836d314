"""/v1/completions logprobs' `text_offset`: each token's offset is the length of the text its
earlier tokens decode to, in context, whatever the stream's chunks (a probe found them summed
from each token's own decode, which drops no leading space, and restarted from each chunk's
text: a speculating server, sending several tokens a chunk, gave other offsets than a plain
one for the same greedy tokens)."""

from types import SimpleNamespace

import pytest

import engine
from parity.fixtures.models import ensure_fixture
from server.openai import completion_logprobs


@pytest.fixture(scope="module")
def tok():
    return engine.load(str(ensure_fixture("llama", "bfloat16")))[1]


def test_offsets_follow_the_decoded_text_whatever_the_chunks(tok):
    ids = tok.encode(" ab ab ab cd", add_special_tokens=False)
    assert tok.decode(ids[:1]) != tok.decode([ids[0]]) or len(ids) > 1
    lps = [{"token": i, "logprob": -1.0} for i in ids]
    state = SimpleNamespace(tokenizer=tok)
    whole = completion_logprobs(state, lps)["text_offset"]
    assert whole == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    for cut in range(1, len(ids)):          # (two chunks, the stream's earlier ids shared)
        before: list = []
        parts = (completion_logprobs(state, lps[:cut], before)["text_offset"]
                 + completion_logprobs(state, lps[cut:], before)["text_offset"])
        assert parts == whole and before == ids
    text = tok.decode(ids)
    for i in range(1, len(ids)):
        assert text[whole[i]:].startswith(tok.decode(ids[:i + 1])[whole[i]:])


def test_offsets_index_the_answer_when_its_first_space_is_dropped(tok):
    """The probe's case: tokens " ab", " ab", ... answered as "ab ab ...": offsets 0, 2, 5,
    ... (were 0, 3, 6, ...), streamed in any chunks or not."""
    ids = tok.encode(" ab ab ab cd", add_special_tokens=False)
    text = tok.decode(ids)[1:]
    lps = [{"token": i, "logprob": -1.0} for i in ids]
    state = SimpleNamespace(tokenizer=tok)
    whole = completion_logprobs(state, lps, text=text)["text_offset"]
    assert whole == [0] + [len(tok.decode(ids[:i])) - 1 for i in range(1, len(ids))]
    for i in range(1, len(ids)):
        assert text[whole[i]:].startswith(tok.decode([ids[i]]))
    for cut in range(1, len(ids)):
        before: list = []
        first = tok.decode(ids[:cut])[1:]
        parts = (completion_logprobs(state, lps[:cut], before, first)["text_offset"]
                 + completion_logprobs(state, lps[cut:], before, text)["text_offset"])
        assert parts == whole
