"""engine.constrained through the engine core: grammar processors travel in
`SamplingParams.processor_factories`, so they work in the solo lane
(`max_batch=1`) and as batch rows alike, and one SamplingParams serving many
requests gives each request its own (stateful) processor."""

from __future__ import annotations

import json

import jsonschema
import pytest

import engine
from engine import Engine, SamplingParams
from engine.constrained import (GrammarProcessor, parse_response_format, parse_tool_choice,
                                response_format_factory, tool_choice_factory,
                                tool_choice_processor)
from engine.text.tools import parse_tool_calls
from starter.models import ensure_fixture

USER = [{"role": "user", "content": "Give me the data."}]
NO_THINK = {"enable_thinking": False}
SCHEMA = {"type": "object", "properties": {
    "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 2, "maxItems": 4},
    "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ids", "color"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def qwen3():
    return engine.load(ensure_fixture("qwen3"))


def _fmt():
    return parse_response_format({"type": "json_schema",
                                  "json_schema": {"name": "o", "schema": SCHEMA, "strict": True}})


def _run(eng, submits):
    rids = [eng.submit(USER, p, template_kwargs=NO_THINK, **kw) for p, kw in submits]
    text, fin = {r: "" for r in rids}, {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            text[o.request_id] += o.text
            if o.finished:
                fin[o.request_id] = o.finish_reason
    return [(text[r], fin[r]) for r in rids]


class Counting:
    """A factory that counts the processors it made (each must be distinct)."""

    def __init__(self, make):
        self.make, self.made = make, []

    def __call__(self):
        p = self.make()
        self.made.append(p)
        return p


@pytest.mark.parametrize("max_batch", [1, 4])
def test_one_params_many_requests_each_validates(qwen3, max_batch):
    model, tok = qwen3
    make = Counting(response_format_factory(tok, _fmt()))
    shared = SamplingParams(max_tokens=200, temperature=1.0, seed=7, processor_factories=(make,))
    plain = SamplingParams(max_tokens=30)
    eng = Engine(model, tok, max_batch=max_batch)
    out = _run(eng, [(shared, {}), (shared, {}), (plain, {}), (shared, {})])
    assert eng.stats()["lanes"]["batch" if max_batch > 1 else "solo"] == 4
    assert len(make.made) == 3 and len({id(p) for p in make.made}) == 3
    assert all(isinstance(p, GrammarProcessor) for p in make.made)
    for i, (text, fin) in enumerate(out):
        if i == 2:
            with pytest.raises(ValueError):
                json.loads(text)
            continue
        assert fin == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_solo_and_batch_lanes_agree_greedy(qwen3):
    """A greedy constrained request writes the same text as a row of a batch,
    through engine.generate (processor objects) and through the Engine."""
    model, tok = qwen3
    make = response_format_factory(tok, _fmt())
    params = SamplingParams(max_tokens=200, temperature=0.0, processor_factories=(make,))
    [(solo, _)] = _run(Engine(model, tok, max_batch=1), [(params, {})])
    [(row, _), (other, _)] = _run(Engine(model, tok, max_batch=4),
                                  [(params, {}), (SamplingParams(max_tokens=20), {})])
    via_generate = engine.generate(model, tok, USER, max_tokens=200, temperature=0.0,
                                   template_kwargs=NO_THINK, logits_processors=[make()]).text
    assert solo == row == via_generate
    jsonschema.validate(json.loads(solo), SCHEMA)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_forced_tool_call_through_engine(qwen3, max_batch):
    model, tok = qwen3
    choice = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    make = tool_choice_factory(tok, "json_tools", TOOLS, choice, parallel=False)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, processor_factories=(make,))
    out = _run(Engine(model, tok, max_batch=max_batch), [(params, {"tools": TOOLS})] * 2)
    for text, fin in out:
        assert fin == "stop", text
        _, calls = parse_tool_calls(text, "json_tools", TOOLS)
        assert [c.name for c in calls] == ["get_weather"], text


def test_auto_choice_has_no_factory(qwen3):
    _, tok = qwen3
    assert tool_choice_factory(tok, "json_tools", TOOLS, parse_tool_choice("auto", TOOLS)) is None
    assert response_format_factory(tok, parse_response_format({"type": "text"})) is None
    assert tool_choice_processor(tok, "json_tools", TOOLS, parse_tool_choice("none", TOOLS)) is None


def test_processor_factories_must_be_callables():
    with pytest.raises(ValueError, match="processor_factories"):
        SamplingParams(processor_factories=("not callable",))
