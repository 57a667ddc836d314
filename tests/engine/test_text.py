"""Property tests: StopMatcher (engine/text/stop.py) and the streaming detokenizer.

No oracle here: the references are written out in this file (a brute-force
"cut at the earliest stop occurrence" and ``Tokenizer.decode``).
"""

from __future__ import annotations

import os
from functools import lru_cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.text.stop import StopMatcher, cut_at_stop
from engine.text.detokenizer import incomplete_utf8_tail as _incomplete_utf8_tail
from engine.text.tokenizer import load_tokenizer
from parity.fixtures.tokenizers import TOKENIZER_FAMILIES, ensure_tokenizer

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------
# StopMatcher
# ---------------------------------------------------------------------------

# A small alphabet makes stop strings, overlaps and partial matches frequent;
# the non-ASCII letters check that nothing assumes one byte per character.
ALPHABET = "ab\nX é😀"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3)


def brute_force_cut(text: str, stops: list[str]) -> str:
    """Reference: the earliest position at which any stop string starts."""
    starts = [i for i in range(len(text)) for s in stops if text.startswith(s, i)]
    return text[: min(starts)] if starts else text


@st.composite
def chunked(draw):
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run_matcher(stops, chunks):
    """Feed chunks until stopped; return (output, stopped, emitted-prefix history)."""
    m = StopMatcher(stops)
    out, history = "", []
    stopped = False
    for c in chunks:
        emit, stopped = m.feed(c)
        out += emit
        history.append(out)
        if stopped:
            break
    if not stopped:
        out += m.flush()
        history.append(out)
    return out, m, history


@SETTINGS
@given(chunked(), stop_lists)
@example(("abcd", ["ab", "cd"]), ["abcd", "bc"])  # bc completes first, abcd starts first
@example(("xaab", ["xa", "a", "b"]), ["aab"])
@example(("aXaXb", ["aX", "aX", "b"]), ["aXaXb", "Xa"])
def test_output_is_reference_cut(tc, stops):
    text, chunks = tc
    out, _, _ = run_matcher(stops, chunks)
    assert out == brute_force_cut(text, stops)
    assert out == cut_at_stop(text, stops)[0]


@SETTINGS
@given(chunked(), chunked(), stop_lists)
def test_any_chunking_same_output(tc1, tc2, stops):
    text, chunks1 = tc1
    # Re-chunk the same text with tc2's cut points scaled onto it.
    _, chunks2 = tc2
    n2 = sum(map(len, chunks2)) or 1
    cuts, acc = set(), 0
    for c in chunks2:
        acc += len(c)
        cuts.add(acc * len(text) // n2)
    bounds = [0, *sorted(cuts), len(text)]
    rechunked = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run_matcher(stops, chunks1)[0] == run_matcher(stops, rechunked)[0]
    assert run_matcher(stops, chunks1)[0] == run_matcher(stops, list(text))[0]
    assert run_matcher(stops, chunks1)[0] == run_matcher(stops, [text])[0]


@SETTINGS
@given(chunked(), stop_lists)
def test_emitted_prefixes_are_safe(tc, stops):
    text, chunks = tc
    ref = brute_force_cut(text, stops)
    _, m, history = run_matcher(stops, chunks)
    for emitted in history:
        # Never retracted, never beyond the cut: so no emitted text contains a
        # stop string, nor the beginning of one that completes later.
        assert ref.startswith(emitted)
        assert not any(s in emitted for s in stops)
    assert len(m.pending) < max(map(len, stops))


@SETTINGS
@given(chunked(), stop_lists)
def test_stopped_flag_and_stop_string(tc, stops):
    text, chunks = tc
    ref = brute_force_cut(text, stops)
    out, m, _ = run_matcher(stops, chunks)
    occurs = len(ref) < len(text)
    assert m.stopped == occurs
    if occurs:
        assert m.stop_string in stops and text.startswith(m.stop_string, len(out))
        assert m.feed("more") == ("", True)
        assert m.flush() == ""
    else:
        assert m.stop_string is None and out == text


def test_stops_as_soon_as_certain():
    m = StopMatcher(["</s>", "STOP"])
    assert m.feed("hello </") == ("hello ", False)
    assert m.pending == "</"
    assert m.feed("s> world") == ("", True)
    assert m.stop_string == "</s>"

    # "bc" is complete but "abcd" started earlier and might still complete.
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("xabc") == ("x", False)
    assert m.feed("z") == ("a", True) and m.stop_string == "bc"
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("xabc") == ("x", False)
    assert m.feed("d") == ("", True) and m.stop_string == "abcd"
    m = StopMatcher(["abcd", "bc"])
    m.feed("xabc")
    assert m.flush() == "a" and m.stopped and m.stop_string == "bc"


def test_no_stops_and_empty_stops():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""
    m = StopMatcher(["", "x"])
    assert m.stops == ("x",)
    assert m.feed("") == ("", False)
    assert m.feed("ab") == ("ab", False)
    assert m.feed("cx") == ("c", True)


def test_multichar_unicode_stop():
    m = StopMatcher(["😀\n"])
    assert m.feed("ok 😀") == ("ok ", False)
    assert m.feed("!") == ("😀!", False)
    assert m.feed("😀") == ("", False)
    assert m.feed("\nrest") == ("", True)


def test_long_stream_is_linear():
    # 20k single-character deltas with a stop that keeps almost matching.
    m = StopMatcher(["<|im_end|>", "\n\nUser:"])
    text = ("<|im_en " * 2500)[:20000]
    out = "".join(m.feed(ch)[0] for ch in text) + m.flush()
    assert out == text


# ---------------------------------------------------------------------------
# UTF-8 hold-back helper
# ---------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _proper_prefixes_of_utf8_chars() -> frozenset[bytes]:
    # A proper prefix never includes the last byte, which holds the low 6 bits,
    # so one code point per block of 64 gives every prefix.
    out = set()
    for cp in range(0x80, 0x110000, 64):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        b = chr(cp).encode("utf-8")
        out.update(b[:k] for k in range(1, len(b)))
    return frozenset(out)


@given(st.binary(max_size=12))
@settings(max_examples=1000, deadline=None)
@example(b"\xed\xa0")  # surrogate: never completes (CPython's incremental decoder buffers it)
@example(b"\xf4\x90")  # beyond U+10FFFF
@example(b"\xe0\x80")  # overlong
@example(b"a\xf0\x9f\x98")  # 3 of 4 bytes of an emoji
def test_incomplete_tail_is_unfinished_character(data):
    """Held back: exactly a trailing proper prefix of some valid UTF-8 character."""
    prefixes = _proper_prefixes_of_utf8_chars()
    expected = max((k for k in range(1, 4) if data[-k:] in prefixes and len(data) >= k), default=0)
    assert _incomplete_utf8_tail(data) == expected


# ---------------------------------------------------------------------------
# Streaming detokenizer
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TOKENIZER_FAMILIES)
def tok(request):
    return load_tokenizer(ensure_tokenizer(request.param))


def _partial_char_ids(tok):
    """Ids whose bytes are not valid UTF-8 on their own (part of a character)."""
    ids = []
    for i in range(len(tok)):
        b = tok._token_bytes[i]
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            ids.append(i)
    return ids


def stream(tok, ids, **kw):
    d = tok.make_detokenizer(**kw)
    segments = []
    for i in ids:
        d.add_token(i)
        segments.append(d.last_segment)
    d.finalize()
    segments.append(d.last_segment)
    return d, segments


def test_fixture_vocab_has_partial_characters(tok):
    # Otherwise the properties below would not exercise the hold-back.
    assert len(_partial_char_ids(tok)) > 20


@given(data=st.data())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_detokenizer_random_ids(tok, data):
    partial = _partial_char_ids(tok)
    any_id = st.integers(0, len(tok) - 1)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(partial)), max_size=40))
    skip = data.draw(st.booleans())
    full = tok.decode(ids, skip_special_tokens=skip)
    d, segments = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(segments) == full == d.text
    assert d.tokens == ids
    # Replacement characters only where decode has them.
    assert sum(s.count("\ufffd") for s in segments) == full.count("\ufffd")


@given(data=st.data())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_detokenizer_valid_text_never_splits_characters(tok, data):
    text = data.draw(st.text(max_size=60))
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    d = tok.make_detokenizer()
    shown = ""
    for i in ids:
        d.add_token(i)
        seg = d.last_segment
        assert "\ufffd" not in seg or "\ufffd" in full
        shown += seg
        assert full.startswith(shown)  # never retracted
        assert shown == d.text
    d.finalize()
    shown += d.last_segment
    assert shown == full
    # A prefix of ids shows exactly the complete characters of its bytes.
    for k in range(len(ids) + 1):
        d.reset()
        for i in ids[:k]:
            d.add_token(i)
        raw = b"".join(tok._token_bytes[i] for i in ids[:k])
        keep = len(raw) - _incomplete_utf8_tail(raw)
        assert d.text == raw[:keep].decode("utf-8", "replace")


def test_detokenizer_trim_leading_space(tok):
    ids = tok.encode("  hi there", add_special_tokens=False)
    d, segs = stream(tok, ids, trim_leading_space=True)
    assert "".join(segs) == tok.decode(ids)[1:] == " hi there"
    d, segs = stream(tok, tok.encode(" ", add_special_tokens=False), trim_leading_space=True)
    assert d.text == ""


def test_detokenizer_reset_and_independent_copies(tok):
    ids = tok.encode("你好 👋 world", add_special_tokens=False)
    a, b = tok.detokenizer, tok.detokenizer
    for i in ids:
        a.add_token(i)
    assert b.text == "" and b.tokens == []
    a.reset()
    assert a.text == "" and a.tokens == [] and a.last_segment == ""
