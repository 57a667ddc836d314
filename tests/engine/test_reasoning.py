"""engine.text.reasoning: per-family markers, the streaming splitter's chunking
invariance (hypothesis), an independent reference split, composition with the
tool-call router, and family detection from real fixture tokenizers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text.reasoning import (REASONING_FORMATS, ChatOutputParser, ReasoningDelta,
                              ReasoningSplitter, collect, default_enable_thinking,
                              get_reasoning_format,
                              parse_chat_output, reasoning_format_for, split_reasoning,
                              starts_in_reasoning)
from engine.text.tools import ContentDelta, ToolCall

HSET = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_split(text, fmt, in_reasoning=False, strip=True):
    """The specification, written independently of the splitter: cut the text at
    alternating markers; reasoning pieces lose surrounding whitespace, content
    right after a closing marker loses its leading whitespace."""
    reasoning, content = [], []
    state, after_close, i = in_reasoning, False, 0
    while True:
        marker = fmt.end if state else fmt.start
        j = text.find(marker, i)
        piece = text[i:] if j == -1 else text[i:j]
        if state:
            reasoning.append(piece.strip() if strip else piece)
        else:
            content.append(piece.lstrip() if after_close and strip else piece)
        if j == -1:
            break
        after_close = state
        state, i = not state, j + len(marker)
    return "".join(reasoning), "".join(content)


def stream(chunks, fmt, **kw):
    s = ReasoningSplitter(fmt, **kw)
    events = []
    for c in chunks:
        events += s.feed(c)
    return events + s.finish()


def joined(events):
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, ContentDelta)))


# ----------------------------------------------------------------- registry

@pytest.mark.parametrize("name,want", [
    ("qwen3", "qwen3"), ("qwen3_moe", "qwen3"), ("qwen3_5", "qwen3"), ("minicpm", "minicpm5"),
    ("minicpm5", "minicpm5"), ("gemma4", "gemma4"), ("gemma4_text", "gemma4"),
])
def test_get_reasoning_format(name, want):
    assert get_reasoning_format(name) is REASONING_FORMATS[want]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "", 7])
def test_get_reasoning_format_unknown(name):
    with pytest.raises(ValueError, match="no reasoning format|expected a model_type"):
        get_reasoning_format(name)


# ----------------------------------------------------------------- examples

@pytest.mark.parametrize("fam", ["qwen3", "minicpm5"])
def test_think_block_then_content(fam):
    text = "<think>\nLet me add.\n2+2=4\n</think>\n\nThe answer is 4."
    assert split_reasoning(text, fam) == ("Let me add.\n2+2=4", "The answer is 4.")
    assert split_reasoning(text, fam, strip=False) == ("\nLet me add.\n2+2=4\n", "\n\nThe answer is 4.")


def test_gemma4_thought_channel():
    text = "<|channel>thought\nPlan: greet.<channel|>Hello!"
    assert split_reasoning(text, "gemma4") == ("Plan: greet.", "Hello!")


def test_prompt_opened_block_starts_in_reasoning():
    # MiniCPM5 with thinking on: the generation prompt ends with "<think>\n"
    assert split_reasoning("hmm\n</think>\n\nok", "minicpm5", in_reasoning=True) == ("hmm", "ok")
    # never closed (cut by max_tokens): everything is reasoning
    assert split_reasoning("still thinking ", "qwen3", in_reasoning=True) == ("still thinking", "")


def test_no_markers_is_content_verbatim():
    assert split_reasoning("  plain <thin text\n", "qwen3") == ("", "  plain <thin text\n")


def test_partial_marker_is_held_then_released():
    s = ReasoningSplitter("qwen3")
    assert s.feed("a <thi") == [ContentDelta("a ")]
    assert s.feed("s is not") == [ContentDelta("<this is not")]
    s = ReasoningSplitter("qwen3", in_reasoning=True)
    assert s.feed("x </thi") == [ReasoningDelta("x")]
    assert s.finish() == [ReasoningDelta(" </thi")]


def test_reasoning_streams_live():
    s = ReasoningSplitter("qwen3")
    assert s.feed("<think>") == []
    assert s.feed("\nstep one") == [ReasoningDelta("step one")]
    assert s.feed(" and two\n") == [ReasoningDelta(" and two")]
    assert s.feed("more</think>\n") == [ReasoningDelta("\nmore")]
    assert s.feed("\nDone") == [ContentDelta("Done")]
    assert s.finish() == []
    with pytest.raises(RuntimeError):
        s.feed("x")


@pytest.mark.parametrize("prompt,fam,want", [
    ("<|im_start|>assistant\n<think>\n", "minicpm5", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "minicpm5", False),
    ("<|im_start|>assistant\n", "qwen3", False),
    ("<|turn>model\n<|channel>thought\n<channel|>", "gemma4", False),
    ("<|turn>model\n", "gemma4", False),
    ("anything", None, False),
])
def test_starts_in_reasoning(prompt, fam, want):
    assert starts_in_reasoning(prompt, fam) is want


# --------------------------------------------------------- property tests

PIECES = st.sampled_from(["<think>", "</think>", "<|channel>thought", "<channel|>", "<",
                          "</", "<th", "</thin", "<|chan", "<channel", "thought", "\n", " ",
                          "\n\n", "  ", "a", "b c", "é😀", "<tool_call>", "{}"])
DOC = st.lists(PIECES, max_size=25).map("".join)


def chunked(text, cuts):
    idx = sorted({min(c, len(text)) for c in cuts})
    bounds = [0] + idx + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@HSET
@given(text=DOC, cuts=st.lists(st.integers(0, 200), max_size=12),
       fam=st.sampled_from(sorted(REASONING_FORMATS)), in_reasoning=st.booleans(),
       strip=st.booleans())
def test_property_any_chunking_equals_one_shot(text, cuts, fam, in_reasoning, strip):
    want = split_reasoning(text, fam, in_reasoning=in_reasoning, strip=strip)
    got = joined(stream(chunked(text, cuts), fam, in_reasoning=in_reasoning, strip=strip))
    assert got == want
    # one character at a time too
    assert joined(stream(list(text), fam, in_reasoning=in_reasoning, strip=strip)) == want


@HSET
@given(text=DOC, fam=st.sampled_from(sorted(REASONING_FORMATS)), in_reasoning=st.booleans(),
       strip=st.booleans())
def test_property_matches_reference(text, fam, in_reasoning, strip):
    fmt = get_reasoning_format(fam)
    assert split_reasoning(text, fam, in_reasoning=in_reasoning, strip=strip) == \
        reference_split(text, fmt, in_reasoning, strip)


# ---------------------------------------------- composition with tool calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

COMPOSED = [
    ("qwen3", "json_tools",
     '<think>\nI should call <tool_call>{"name": "get_weather", "arguments": {"city": "X"}}'
     '</tool_call> maybe\n</think>\n\nSure. <tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}\n</tool_call>'),
    ("minicpm5", "minicpm5",
     '<think>plan</think>\n<function name="get_weather"><param name="city">Paris</param>'
     '</function>'),
    ("gemma4", "gemma4",
     '<|channel>thought\nweather?<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}'
     '<tool_call|>'),
]


def counter_ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


@pytest.mark.parametrize("fam,tfmt,text", COMPOSED)
def test_reasoning_then_tool_call(fam, tfmt, text):
    out = parse_chat_output(text, fam, tfmt, TOOLS, id_factory=counter_ids())
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert "get_weather" not in out.content and out.reasoning
    if fam == "qwen3":  # a call written inside reasoning is a thought, not a call
        assert "<tool_call>" in out.reasoning and out.content.strip() == "Sure."


@HSET
@given(data=st.data())
def test_property_composed_chunking_invariant(data):
    fam, tfmt, text = data.draw(st.sampled_from(COMPOSED))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=15))
    want = parse_chat_output(text, fam, tfmt, TOOLS, id_factory=counter_ids())
    p = ChatOutputParser(fam, tfmt, TOOLS, id_factory=counter_ids())
    events = []
    for c in chunked(text, cuts):
        events += p.feed(c)
    got = collect(events + p.finish())
    assert got == want
    assert all(not isinstance(e, ToolCall) or e.name == "get_weather" for e in events)


def test_parser_without_reasoning_is_the_router():
    out = parse_chat_output("<think>x</think>hi", None, None)
    assert (out.reasoning, out.content, out.tool_calls) == ("", "<think>x</think>hi", [])


# ------------------------------------------ detection from fixture tokenizers

@pytest.fixture(scope="module")
def tokenizers():
    from engine.text.tokenizer import load_tokenizer
    from starter.models import ensure_fixture
    return {f: load_tokenizer(ensure_fixture(f)) for f in ("qwen3", "minicpm", "gemma4", "llama")}


@pytest.mark.parametrize("family,want", [("qwen3", "qwen3"), ("minicpm", "minicpm5"),
                                         ("gemma4", "gemma4"), ("llama", None)])
def test_reasoning_format_from_tokenizer(tokenizers, family, want):
    fmt = reasoning_format_for(tokenizers[family])
    assert (fmt.name if fmt else None) == want


@pytest.mark.parametrize("family,thinking,want", [
    ("qwen3", True, False), ("qwen3", False, False),   # Qwen3 writes <think> itself
    ("minicpm", True, True), ("minicpm", False, False),
    ("gemma4", True, False), ("gemma4", False, False),
])
def test_initial_state_from_rendered_prompt(tokenizers, family, thinking, want):
    tok = tokenizers[family]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     enable_thinking=thinking)
    assert starts_in_reasoning(prompt, reasoning_format_for(tok)) is want


def test_markers_survive_detokenization(tokenizers):
    """The markers are special tokens for MiniCPM5 and Gemma 4: the default
    detokenizer keeps them, so the splitter sees them."""
    for family in ("minicpm", "gemma4", "qwen3"):
        tok = tokenizers[family]
        fmt = reasoning_format_for(tok)
        ids = tok.encode(f"{fmt.start}\nwhy{fmt.end}because", add_special_tokens=False)
        d = tok.make_detokenizer()
        for i in ids:
            d.add_token(i)
        d.finalize()
        assert split_reasoning(d.text, fmt) == ("why", "because")


@pytest.mark.parametrize("family,want", [("minicpm", False), ("qwen3", None), ("gemma4", None),
                                         ("llama", None)])
def test_default_enable_thinking(tokenizers, family, want):
    """MiniCPM5 answers directly unless asked: its default renders a closed block."""
    tok = tokenizers[family]
    assert default_enable_thinking(tok) is want
    if want is False:
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         enable_thinking=want)
        assert not starts_in_reasoning(prompt, reasoning_format_for(tok))
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) \
            != prompt   # the tokenizer's own default (mlx-lm's) would think
