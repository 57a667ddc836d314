"""engine.text.prefix_encode: a grown conversation's ids, reusing the earlier text's, equal
the ids of encoding the whole text (every fixture tokenizer; edits anywhere, special-token
text in the content, texts that part inside a special token)."""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from engine.text.prefix_encode import PrefixEncoder
from engine.text.tokenizer import load_tokenizer
from parity.fixtures.tokenizers import TOKENIZER_FAMILIES, ensure_tokenizer

WORDS = ("file read write  edit\tsearch grep\n run test build diff\n\n patch héllo 你好 ünïcode "
         "x=1; def f(): return {'a': [1, 2]} \"quoted\" 12345 ").split(" ")


@pytest.fixture(scope="module", params=TOKENIZER_FAMILIES)
def tok(request):
    return load_tokenizer(ensure_tokenizer(request.param))


def _specials(tok) -> list:
    return sorted(tok.added_tokens.values())


def _text(rnd: random.Random, tok, n: int) -> str:
    specials = _specials(tok)
    out = []
    for _ in range(n):
        r = rnd.random()
        if r < 0.08:
            out.append(rnd.choice(specials))
        elif r < 0.12:
            s = rnd.choice(specials)          # half a special token, or one glued to text
            out.append(s[:rnd.randrange(1, len(s))] if rnd.random() < 0.5 else "a" + s + "b")
        else:
            out.append(rnd.choice(WORDS) + rnd.choice(("", " ", "  ", "\n", " \n")))
    return "".join(out)


def _whole(tok, text: str) -> list:
    return tok.backend.encode(text, add_special_tokens=False).ids


def test_grown_texts_equal_whole_encodes(tok):
    rnd = random.Random(0)
    reused = 0
    for trial in range(60):
        enc = PrefixEncoder(tok.backend, min_text=0)
        base = _text(rnd, tok, rnd.randrange(20, 200))
        assert enc.encode(base) == _whole(tok, base)
        k = rnd.randrange(0, len(base) + 1)
        for new in (base[:k] + _text(rnd, tok, rnd.randrange(0, 60)),   # parts at k
                    base + _text(rnd, tok, rnd.randrange(1, 60)),       # grows
                    base[:k]):                                          # shrinks
            assert enc.encode(new) == _whole(tok, new), (trial, k)
        reused += enc.reused
    assert reused > 0


def test_parting_inside_a_special_token(tok):
    enc = PrefixEncoder(tok.backend, min_text=0)
    for s in _specials(tok):
        base = "hello " + s + " world " * 20 + s + " tail"
        assert enc.encode(base) == _whole(tok, base)
        for cut in range(len(base) - len(s) - 6, len(base)):
            new = base[:cut] + "Z" + s[1:]
            assert enc.encode(new) == _whole(tok, new)


def test_conversation_turns_reuse_and_match(tok):
    """The chat template's prompts of a growing conversation: each turn equals its whole
    encode, and turns after the first reuse the earlier turn's ids."""
    rnd = random.Random(1)
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": _text(rnd, tok, 30),
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
        for i in range(3)]
    msgs = [{"role": "system", "content": " ".join(rnd.choice(WORDS) for _ in range(600))}]
    before = tok._prefix_encoder.reused
    for turn in range(4):
        msgs.append({"role": "user", "content": " ".join(rnd.choice(WORDS) for _ in range(80))})
        text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
        assert tok.apply_chat_template(msgs, tools=tools) == _whole(tok, text)
        msgs.append({"role": "assistant", "content": " ".join(rnd.choice(WORDS) for _ in range(20))})
    assert tok._prefix_encoder.reused > before


def test_split_special_tokens_never_cut(tok):
    backend = tok.backend
    enc = PrefixEncoder(backend, min_text=0)
    backend.encode_special_tokens = True
    try:
        assert not enc.enabled
        s = _specials(tok)[0]
        text = "a " + s + " b" * 50
        assert enc.encode(text) == _whole(tok, text)
    finally:
        backend.encode_special_tokens = False
