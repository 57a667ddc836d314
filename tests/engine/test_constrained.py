"""engine.constrained: structured outputs and forced tool calls on the random-weight
fixtures, in the serial loop and in the batch scheduler. Every output is checked
with the `jsonschema` package (a model with random weights writes garbage unless
the grammar holds it), every forced call is parsed back with the family's own
tool parser and its arguments validated against the tool's schema."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import engine
from engine.step.batch import BatchRequest, BatchScheduler
from engine.constrained import (ConstraintError, GrammarDeadEnd, ResponseFormat, ToolChoice,
                                parse_response_format, parse_tool_choice,
                                response_format_processor, tool_choice_processor)
from engine.constrained.grammars import close_objects
from engine.text.reasoning import ChatOutputParser, collect, parse_chat_output, split_reasoning
from engine.step.sampling import make_sampler
from engine.text.tools import parse_tool_calls
from starter.models import ensure_fixture

USER = [{"role": "user", "content": "Give me the data."}]
NO_THINK = {"enable_thinking": False}

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {"type": "object", "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "lines": {"type": "array", "items": {"type": "string", "maxLength": 6},
                          "maxItems": 2}},
                "required": ["zip", "lines"]}},
            "required": ["name", "address"]}},
        "required": ["person"]},
    "arrays": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 2, "maxItems": 4},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"},
                                              "maxItems": 2}, "maxItems": 2}},
        "required": ["ids", "matrix"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "kind": {"const": "fixed"},
        "level": {"enum": [1, 2, 3, None]}},
        "required": ["color", "size", "kind", "level"]},
    "numbers": {"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
        "ratio": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["price", "count", "ratio"]},
    "patterns_optional": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "note": {"type": ["string", "null"], "maxLength": 5},
        "maybe": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["code", "email", "note"]},
    "anyof": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                            {"type": "string", "enum": ["none"]}]},
        "flag": {"type": "boolean"}},
        "required": ["value", "flag"]},
    "top_array": {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 3}}, "required": ["k"]}, "minItems": 1,
        "maxItems": 3},
}


@pytest.fixture(scope="module")
def qwen3():
    return engine.load(ensure_fixture("qwen3"))


def _format(schema):
    return parse_response_format({"type": "json_schema",
                                  "json_schema": {"name": "out", "schema": schema, "strict": True}})


def _serial(model, tok, procs, *, temp=0.0, seed=0, max_tokens=400, prompt=USER, tools=None,
            template=NO_THINK, **kw):
    return engine.generate(model, tok, prompt, max_tokens=max_tokens, temperature=temp, seed=seed,
                           logits_processors=procs, tools=tools, template_kwargs=template, **kw)


def _batch(model, tok, rows, max_tokens=200):
    """rows: [(prompt ids, processors, sampler, seed)] -> [(text, finish_reason)]."""
    sched = BatchScheduler(model, tokenizer=tok)
    uids = [sched.submit(BatchRequest(p, max_tokens=max_tokens, logits_processors=procs,
                                      sampler=s, seed=seed)) for p, procs, s, seed in rows]
    text, fin = {u: "" for u in uids}, {}
    for ev in sched.run():
        text[ev.uid] += ev.text
        if ev.finish_reason:
            fin[ev.uid] = ev.finish_reason
    return [(text[u], fin[u]) for u in uids]


# ------------------------------------------------------------ request parsing

def test_parse_response_format_shapes():
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) == ResponseFormat("text")
    assert parse_response_format({"type": "json_object"}) == ResponseFormat("json_object")
    s = {"type": "object"}
    chat = parse_response_format({"type": "json_schema",
                                  "json_schema": {"name": "n", "schema": s, "strict": True}})
    responses = parse_response_format({"type": "json_schema", "name": "n", "schema": s,
                                       "strict": True}, param="text.format")
    assert chat == responses == ResponseFormat("json_schema", s, "n", True)


@pytest.mark.parametrize("value,param", [
    ({"type": "nonsense"}, "response_format.type"),
    ("json", "response_format"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": 3}}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
     "response_format.strict"),
])
def test_parse_response_format_errors_name_the_param(value, param):
    with pytest.raises(ConstraintError) as e:
        parse_response_format(value)
    assert e.value.param == param


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {
                 "city": {"type": "string", "maxLength": 12},
                 "days": {"type": "integer", "minimum": 1, "maximum": 7},
                 "unit": {"type": "string", "enum": ["c", "f"]},
                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                 "opts": {"type": "object", "properties": {"x": {"type": "boolean"}},
                          "required": ["x"]}},
             "required": ["city", "days", "unit"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
             "required": ["tz"]}}}]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("value,want", [
    (None, ToolChoice("auto")), ("auto", ToolChoice("auto")), ("none", ToolChoice("none")),
    ("required", ToolChoice("required")),
    ({"type": "function", "function": {"name": "get_time"}}, ToolChoice("function", "get_time")),
    ({"type": "function", "name": "get_time"}, ToolChoice("function", "get_time")),   # Responses
    ({"type": "any"}, ToolChoice("required")), ({"type": "auto"}, ToolChoice("auto")),  # Anthropic
    ({"type": "tool", "name": "get_weather"}, ToolChoice("function", "get_weather")),
    ({"type": "none"}, ToolChoice("none")),
])
def test_parse_tool_choice_shapes(value, want):
    assert parse_tool_choice(value, TOOLS) == want


@pytest.mark.parametrize("value,tools,match", [
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "not among the tools"),
    ("required", None, "needs tools"),
    ("sometimes", TOOLS, "must be"),
    ({"type": "function", "function": {}}, TOOLS, "must name"),
    ({"type": "web_search"}, TOOLS, "not supported"),
    (3, TOOLS, "string or an object"),
])
def test_parse_tool_choice_errors(value, tools, match):
    with pytest.raises(ConstraintError, match=match) as e:
        parse_tool_choice(value, tools)
    assert e.value.param.startswith("tool_choice")


def test_close_objects_only_narrows():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                          "b": {"type": "array", "items": {"properties": {}}}},
         "$defs": {"d": {"properties": {}, "additionalProperties": True}}}
    c = close_objects(s)
    assert c["additionalProperties"] is False
    assert c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["b"]["items"]["additionalProperties"] is False
    assert c["$defs"]["d"]["additionalProperties"] is True          # explicit value kept
    assert "additionalProperties" not in s                            # input untouched


def test_unusable_schema_is_a_constraint_error(qwen3):
    _, tok = qwen3
    with pytest.raises(ConstraintError) as e:
        response_format_processor(tok, _format({"type": "object", "properties": {
            "a": {"$ref": "#/$defs/missing"}}}))
    assert e.value.param == "response_format"


# ------------------------------------------------------ the processor itself

def test_processor_only_masks(qwen3):
    """Allowed tokens keep their logits bit for bit; the rest become -inf; the
    input array is left alone."""
    _, tok = qwen3
    proc = response_format_processor(tok, _format(SCHEMAS["enums"]))
    logits = mx.random.normal((1, 1024), key=mx.random.key(0))
    before = np.array(logits)
    out = np.array(proc(mx.array([1, 2, 3]), logits))
    allowed = proc.allowed(1024)
    assert 0 < allowed.sum() < 1024
    assert np.array_equal(out[0, allowed], before[0, allowed])
    assert np.all(np.isneginf(out[0, ~allowed]))
    assert np.array_equal(np.array(logits), before)


def test_model_vocab_larger_than_tokenizer(qwen3):
    """Checkpoints often pad the embedding past the tokenizer: the padding ids
    are never allowed."""
    _, tok = qwen3
    proc = response_format_processor(tok, ResponseFormat("json_object"))
    out = np.array(proc(mx.array([1]), mx.zeros((1, tok.vocab_size + 64))))
    assert out.shape == (1, tok.vocab_size + 64)
    assert np.all(np.isneginf(out[0, tok.vocab_size:])) and np.isfinite(out[0]).any()


def test_forbidden_token_ends_the_request(qwen3):
    """A token the grammar cannot take (only possible if something else picked
    it) puts the processor in an error state: the processor raises
    GrammarDeadEnd, so the request ends with an error, never as a success."""
    _, tok = qwen3
    proc = response_format_processor(tok, ResponseFormat("json_object"))
    proc(mx.array([5, 6]), mx.zeros((1, 1024)))
    bad = tok.encode("x", add_special_tokens=False)[0]       # JSON cannot start with x
    with pytest.raises(GrammarDeadEnd, match="cannot follow the grammar"):
        proc(mx.array([5, 6, bad]), mx.zeros((1, 1024)))
    assert proc.error


# ---------------------------------------------------- structured outputs, serial

@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temp,seed", [(0.0, 0), (1.0, 7)])
def test_json_schema_serial_validates(qwen3, name, temp, seed):
    model, tok = qwen3
    proc = response_format_processor(tok, _format(SCHEMAS[name]))
    r = _serial(model, tok, [proc], temp=temp, seed=seed)
    assert r.finish_reason == "stop", r.text
    jsonschema.validate(json.loads(r.text), SCHEMAS[name])


def test_json_object_serial(qwen3):
    model, tok = qwen3
    proc = response_format_processor(tok, parse_response_format({"type": "json_object"}))
    r = _serial(model, tok, [proc])
    assert r.finish_reason == "stop"
    assert isinstance(json.loads(r.text), dict)


def test_unconstrained_output_is_not_json(qwen3):
    """Negative control: without the processor the random model's text is not JSON."""
    model, tok = qwen3
    r = _serial(model, tok, [], max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(r.text)


# ----------------------------------------------------- structured outputs, batch

def test_json_schema_batch_of_8_validates(qwen3):
    """Eight rows in one batch, each with its own schema and sampler (greedy,
    seeded temperature), next to an unconstrained row."""
    model, tok = qwen3
    prompt = tok.apply_chat_template(USER, enable_thinking=False)
    names = sorted(SCHEMAS)
    rows, want = [], []
    for i in range(8):
        name = names[i % len(names)]
        sampler = make_sampler(temp=1.0) if i % 2 else None
        rows.append((prompt, [response_format_processor(tok, _format(SCHEMAS[name]))], sampler,
                     100 + i if i % 2 else None))
        want.append(SCHEMAS[name])
    rows.append((prompt, [], None, None))
    out = _batch(model, tok, rows)
    for (text, fin), schema in zip(out, want):
        assert fin == "stop", text
        jsonschema.validate(json.loads(text), schema)
    with pytest.raises(ValueError):
        json.loads(out[-1][0])


def test_batch_row_equals_serial_with_constraint(qwen3):
    """A constrained greedy row in a batch writes what the serial loop writes."""
    model, tok = qwen3
    prompt = tok.apply_chat_template(USER, enable_thinking=False)
    fmt = _format(SCHEMAS["numbers"])
    serial = _serial(model, tok, [response_format_processor(tok, fmt)]).text
    other = response_format_processor(tok, _format(SCHEMAS["enums"]))
    [(a, _), (b, _)] = _batch(model, tok, [(prompt, [response_format_processor(tok, fmt)], None,
                                            None), (prompt, [other], None, None)])
    assert a == serial
    jsonschema.validate(json.loads(b), SCHEMAS["enums"])


# ------------------------------------------------------------- forced tool calls

FAMILIES = [("llama", "json_tools"), ("qwen3", "json_tools"), ("qwen3", "qwen3_coder"),
            ("gemma4", "gemma4"), ("minicpm", "minicpm5")]


@pytest.fixture(scope="module")
def models():
    return {f: engine.load(ensure_fixture(f)) for f in ("llama", "qwen3", "gemma4", "minicpm")}


def _check_calls(text, tool_format, name=None, at_least=1):
    content, calls = parse_tool_calls(text, tool_format, TOOLS)
    assert len(calls) >= at_least, text
    assert content.strip() == "", text
    for c in calls:
        if name is not None:
            assert c.name == name
        jsonschema.validate(c.arguments, SCHEMA_OF[c.name])
    return calls


@pytest.mark.parametrize("family,tool_format", FAMILIES)
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_tool_call_serial(models, family, tool_format, choice):
    model, tok = models[family]
    value = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    tc = parse_tool_choice(value, TOOLS)
    for temp, seed in ((0.0, 0), (1.0, 3)):
        proc = tool_choice_processor(tok, tool_format, TOOLS, tc)
        r = _serial(model, tok, [proc], temp=temp, seed=seed, tools=TOOLS, max_tokens=300)
        assert r.finish_reason == "stop", r.text
        _check_calls(r.text, tool_format, None if choice == "required" else choice)


@pytest.mark.parametrize("family,tool_format", FAMILIES)
def test_forced_tool_call_batch(models, family, tool_format):
    model, tok = models[family]
    prompt = tok.apply_chat_template(USER, tools=TOOLS, enable_thinking=False)
    rows, names = [], []
    for i in range(4):
        name = [None, "get_weather", "get_time", "get_weather"][i]
        tc = ToolChoice("required") if name is None else ToolChoice("function", name)
        rows.append((prompt, [tool_choice_processor(tok, tool_format, TOOLS, tc, parallel=False)],
                     make_sampler(temp=1.0), 50 + i))
        names.append(name)
    for (text, fin), name in zip(_batch(model, tok, rows, max_tokens=300), names):
        assert fin == "stop", text
        assert len(_check_calls(text, tool_format, name)) == 1


def test_auto_and_none_build_no_processor(qwen3):
    _, tok = qwen3
    for v in ("auto", "none"):
        assert tool_choice_processor(tok, "json_tools", TOOLS, parse_tool_choice(v, TOOLS)) is None
    assert response_format_processor(tok, parse_response_format({"type": "text"})) is None


def test_unknown_tool_format_is_a_constraint_error(qwen3):
    _, tok = qwen3
    with pytest.raises(ConstraintError, match="no forced-call grammar"):
        tool_choice_processor(tok, "pythonic", TOOLS, ToolChoice("required"))


# ------------------------------------------------------------ with reasoning

def test_reasoning_then_json_with_budget(qwen3):
    """Qwen3 thinking on: the model may reason first (at most `budget` tokens),
    then the JSON; the reasoning splitter takes the block out. A logit bias on
    <think> makes this random model open the block (the grammar allows it only
    as the first token, so the bias acts once)."""
    model, tok = qwen3
    think = tok.convert_tokens_to_ids("<think>")
    for budget in (3, 8):
        proc = response_format_processor(tok, _format(SCHEMAS["enums"]), reasoning="qwen3",
                                         reasoning_budget=budget)
        r = _serial(model, tok, [proc], temp=1.0, seed=11, template={"enable_thinking": True},
                    logit_bias={think: 30.0})
        assert r.finish_reason == "stop" and r.text.startswith("<think>"), r.text
        reasoning, content = split_reasoning(r.text, "qwen3")
        jsonschema.validate(json.loads(content), SCHEMAS["enums"])
        assert r.token_ids[0] == think and tok.convert_tokens_to_ids("</think>") in r.token_ids
        assert r.token_ids.index(tok.convert_tokens_to_ids("</think>")) <= budget + 1


def test_prompt_opened_reasoning_then_tool_call(models):
    """MiniCPM5 thinking on: the prompt opens <think>; the grammar requires the
    block to close before the call, and the budget forces it closed."""
    model, tok = models["minicpm"]
    proc = tool_choice_processor(tok, "minicpm5", TOOLS, ToolChoice("function", "get_time"),
                                 reasoning="minicpm5", in_reasoning=True, reasoning_budget=5)
    r = _serial(model, tok, [proc], temp=1.0, seed=2, tools=TOOLS, max_tokens=300,
                template={"enable_thinking": True})
    assert r.finish_reason == "stop" and "</think>" in r.text
    reasoning, content = split_reasoning(r.text, "minicpm5", in_reasoning=True)
    _check_calls(content, "minicpm5", "get_time")


def test_streamed_segments_split_like_the_whole_text(qwen3):
    """engine.stream_generate's segments through ChatOutputParser give what the
    one-shot parse of the whole text gives: reasoning, then valid JSON content."""
    model, tok = qwen3
    think = tok.convert_tokens_to_ids("<think>")
    proc = response_format_processor(tok, _format(SCHEMAS["enums"]), reasoning="qwen3",
                                     reasoning_budget=6)
    segs = [s.text for s in engine.stream_generate(
        model, tok, USER, max_tokens=200, temperature=1.0, seed=4, logits_processors=[proc],
        logit_bias={think: 30.0}, template_kwargs={"enable_thinking": True})]
    assert len(segs) > 5
    parser = ChatOutputParser("qwen3")
    events = [e for s in segs for e in parser.feed(s)] + parser.finish()
    streamed = collect(events)
    assert streamed == parse_chat_output("".join(segs), "qwen3")
    assert streamed.reasoning and not streamed.tool_calls
    jsonschema.validate(json.loads(streamed.content), SCHEMAS["enums"])
