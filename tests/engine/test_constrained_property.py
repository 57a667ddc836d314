"""Forced tool calls and JSON outputs over generated schemas (hypothesis).

No model: a random walk picks any token the grammar allows at each step (a
model with arbitrary weights could pick any of them). Whatever the walk
writes, the family's own parser must read one call back, to the right tool,
with arguments valid against the tool's schema (`jsonschema`)."""

from __future__ import annotations

import json
import string

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.constrained import ResponseFormat, ToolChoice, response_format_processor
from engine.constrained import tool_choice_processor
from engine.text.tokenizer import load_tokenizer
from engine.text.tools import parse_tool_calls
from starter.models import ensure_fixture

HSET = settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

FORMATS = {"json_tools": "qwen3", "qwen3_coder": "qwen3", "gemma4": "gemma4",
           "minicpm5": "minicpm"}


@pytest.fixture(scope="module")
def tokenizers():
    return {f: load_tokenizer(ensure_fixture(f)) for f in ("qwen3", "gemma4", "minicpm")}


def walk(proc, tok, seed, max_steps=400):
    """Token ids of a random walk through the grammar (EOS excluded), and
    whether it ended on an EOS token. Prefers EOS once allowed, so it ends."""
    rng = np.random.default_rng(seed)
    eos = sorted(tok.eos_token_ids)
    hist, logits = [0], mx.zeros((1, tok.vocab_size))
    for _ in range(max_steps):
        allowed = np.nonzero(np.isfinite(np.array(proc(mx.array(hist), logits)[0])))[0]
        assert allowed.size, "the grammar allowed nothing"
        ends = [t for t in allowed if t in eos]
        if ends and rng.random() < 0.7:
            return hist[1:], True
        pick = int(rng.choice(allowed))
        if pick in eos:
            return hist[1:], True
        hist.append(pick)
    return hist[1:], False


NAME = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)
TEXT = st.text(alphabet=string.ascii_letters + " <&>\"'é😀_-", min_size=1, max_size=6)
LEAF = st.one_of(
    st.builds(lambda hi: {"type": "string", "maxLength": hi}, st.integers(0, 5)),
    st.builds(lambda lo: {"type": "string", "minLength": lo, "maxLength": lo + 2},
              st.integers(1, 3)),
    st.builds(lambda vs: {"type": "string", "enum": vs},
              st.lists(TEXT, min_size=1, max_size=3, unique=True)),
    st.just({"type": "string", "pattern": "^[a-z]{1,3}-[0-9]$"}),
    st.builds(lambda a, b: {"type": "integer", "minimum": a, "maximum": a + b},
              st.integers(-20, 20), st.integers(0, 30)),
    st.just({"type": "number", "minimum": -5, "maximum": 5}),
    st.just({"type": "boolean"}),
    st.just({"type": ["string", "null"], "maxLength": 3}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.integers(0, 9), min_size=1, max_size=3,
                                                 unique=True)),
)
PARAM = st.one_of(
    LEAF,
    st.builds(lambda it: {"type": "array", "items": it, "maxItems": 3}, LEAF),
    st.builds(lambda props: {"type": "object", "properties": props,
                             "required": sorted(props)[:1]},
              st.dictionaries(NAME, LEAF, min_size=1, max_size=2)),
)


@st.composite
def tool_schema(draw):
    props = draw(st.dictionaries(NAME, PARAM, min_size=0, max_size=4))
    required = [k for k in props if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required}


@HSET
@given(schema=tool_schema(), other=tool_schema(), seed=st.integers(0, 2**31),
       fmt=st.sampled_from(sorted(FORMATS)), named=st.booleans())
def test_property_forced_call_parses_and_validates(tokenizers, schema, other, seed, fmt, named):
    tok = tokenizers[FORMATS[fmt]]
    tools = [{"type": "function", "function": {"name": "alpha", "parameters": schema}},
             {"type": "function", "function": {"name": "beta", "parameters": other}}]
    choice = ToolChoice("function", "alpha") if named else ToolChoice("required")
    proc = tool_choice_processor(tok, fmt, tools, choice, parallel=False)
    ids, ended = walk(proc, tok, seed)
    assert ended, tok.decode(ids)
    text = tok.decode(ids)
    content, calls = parse_tool_calls(text, fmt, tools)
    assert len(calls) == 1 and content.strip() == "", text
    call = calls[0]
    assert call.name == "alpha" or not named
    jsonschema.validate(call.arguments, schema if call.name == "alpha" else other)


@HSET
@given(schema=tool_schema(), seed=st.integers(0, 2**31))
def test_property_json_schema_output_validates(tokenizers, schema, seed):
    tok = tokenizers["qwen3"]
    proc = response_format_processor(tok, ResponseFormat("json_schema", schema))
    ids, ended = walk(proc, tok, seed)
    assert ended
    jsonschema.validate(json.loads(tok.decode(ids)), schema)


MARKUP = {
    "gemma4": ('<|tool_call>call:f{s:<|"|>', '<|"|>}<tool_call|>'),
    "qwen3_coder": ("<tool_call>\n<function=f>\n<parameter=s>\n",
                    "\n</parameter>\n</function>\n</tool_call>"),
    "minicpm5": ('<function name="f"><param name="s">', "</param></function>"),
}


@pytest.mark.parametrize("fmt,value,ok,parsed", [
    ("gemma4", "a < b", True, "a < b"),
    ("gemma4", "<<c <", True, "<<c <"),
    ("gemma4", "a<|b", False, None),
    ("qwen3_coder", "if a < b:\n    x = '<'", True, "if a < b:\n    x = '<'"),
    ("qwen3_coder", "a</b", False, None),
    ("minicpm5", "a &lt; b &amp;&amp; c", True, "a < b && c"),
    ("minicpm5", "New York", True, "New York"),
    ("minicpm5", "a < b", False, None),
    ("minicpm5", " padded", False, None),
])
def test_unlimited_text_values(tokenizers, fmt, value, ok, parsed):
    _check_text_value(tokenizers, fmt, value, ok, parsed, {"type": "string"})


@pytest.mark.parametrize("fmt,value,ok", [
    ("qwen3_coder", "a\nb\n", True), ("qwen3_coder", "x", True),
    ("qwen3_coder", "a<b", False), ("qwen3_coder", "y" * 9, False),
    ("gemma4", "two\nline", True), ("gemma4", "y" * 9, False),
    ("minicpm5", "in side", True), ("minicpm5", "y" * 9, False), ("minicpm5", "a ", False),
])
def test_length_limited_text_values(tokenizers, fmt, value, ok):
    _check_text_value(tokenizers, fmt, value, ok, value, {"type": "string", "maxLength": 8})


def _check_text_value(tokenizers, fmt, value, ok, parsed, schema):
    """A string parameter with no length limit may hold '<' (where it cannot
    start the closing markup) or, in MiniCPM5, XML entities; what the grammar
    accepts parses back to the intended value."""
    tok = tokenizers[FORMATS[fmt]]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": schema}, "required": ["s"]}}}]
    proc = tool_choice_processor(tok, fmt, tools, ToolChoice("function", "f"), parallel=False)
    head, tail = MARKUP[fmt]
    text = head + value + tail
    m = proc.matcher
    accepted = m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    assert accepted is ok, m.get_error()
    if ok:
        assert [c.arguments for c in parse_tool_calls(text, fmt, tools)[1]] == [{"s": parsed}]


# ------------------------------------------- hostile schemas: never invalid as success

SPECIAL = st.sampled_from(["<|im_end|>", "<|endoftext|>", "<tool_call>", "<think>"])
HOSTILE = st.one_of(
    st.builds(lambda s, pre: {"const": pre + s + "y"}, SPECIAL, st.sampled_from(["", "x"])),
    st.builds(lambda s: {"enum": ["ok", "a" + s]}, SPECIAL),
    st.just({"$ref": "#"}),
    st.just({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
             "$ref": "#/$defs/a"}),
    st.just({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    st.builds(lambda n: {"type": "array", "minItems": n}, st.sampled_from([10**6, 1e9])),
    st.just({"type": "string", "pattern": "((a{100}){100}){100}"}),
    st.builds(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                          for i in range(n)}},
              st.sampled_from([520, 700])),
    st.builds(lambda s: {"type": "string", "pattern": "^a" + s.replace("|", "\\|") + "$"},
              SPECIAL),
    st.just({"type": "strng"}),
)


@st.composite
def hostile_schema(draw):
    """A generated object schema with a hostile piece at the top or inside it."""
    base = draw(tool_schema())
    bad = draw(HOSTILE)
    where = draw(st.sampled_from(["top", "property", "required_property"]))
    if where == "top":
        return bad
    props = dict(base["properties"])
    props["zz"] = bad
    req = list(base["required"]) + (["zz"] if where == "required_property" else [])
    return {"type": "object", "properties": props, "required": req}


@HSET
@given(schema=st.one_of(tool_schema(), hostile_schema()), seed=st.integers(0, 2**31))
def test_property_json_schema_never_invalid_as_success(tokenizers, schema, seed):
    """Refused up front (ConstraintError), or ended with GrammarDeadEnd, or cut by the
    step limit (finish "length"); an output that ends on EOS always validates."""
    from engine.constrained import ConstraintError, GrammarDeadEnd
    tok = tokenizers["qwen3"]
    try:
        proc = response_format_processor(tok, ResponseFormat("json_schema", schema))
    except ConstraintError:
        return
    try:
        ids, ended = walk(proc, tok, seed, max_steps=120)
    except GrammarDeadEnd:
        return
    if ended:
        jsonschema.validate(json.loads(tok.decode(ids)), schema)
