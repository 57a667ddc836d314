"""Structured outputs and enforced tool_choice through the server (official
SDKs): the request field becomes a grammar processor in the request's
SamplingParams, so a random-weight model writes schema-valid JSON / the named
tool call, on the solo lane (`srv`, --batch 1) and as rows of a batch."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from srv_helpers import start_server, stop_server, uniq

SCHEMA = {"type": "object", "properties": {
    "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 1, "maxItems": 3},
    "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ids", "color"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def batched(qwen_dir):
    s = start_server(qwen_dir, batch=4, prompt_cache_bytes=0, max_tokens=64)
    yield s
    stop_server(s)


@pytest.fixture(params=["solo", "batch"])
def clients(request, srv, batched):
    from anthropic import Anthropic
    from openai import OpenAI
    s = srv if request.param == "solo" else batched
    return (OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=120),
            Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120))


def test_openai_chat_response_format_json_schema(clients):
    oai, _ = clients

    def one(seed):
        r = oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": uniq()}], max_tokens=120,
            temperature=1.0, seed=seed, response_format={"type": "json_schema", "json_schema": {
                "name": "out", "schema": SCHEMA, "strict": True}})
        return r.choices[0]
    with ThreadPoolExecutor(3) as ex:            # concurrent: rows of one batch
        choices = list(ex.map(one, (1, 2, 3)))
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_openai_chat_forced_tool_call(clients):
    oai, _ = clients
    r = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": uniq()}], max_tokens=120,
        temperature=1.0, seed=5, tools=TOOLS, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_anthropic_tool_choice_tool_is_enforced(clients):
    _, claude = clients
    r = claude.messages.create(
        model="m", max_tokens=120,
        messages=[{"role": "user", "content": uniq()}],
        tools=[{"name": "get_weather", "input_schema": CITY},
               {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use", r.content
    uses = [b for b in r.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, CITY)


def test_responses_text_format_json_schema(clients):
    oai, _ = clients
    r = oai.responses.create(model="m", input=uniq(), max_output_tokens=120, temperature=1.0,
                             text={"format": {"type": "json_schema", "name": "out",
                                              "schema": SCHEMA, "strict": True}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_responses_forced_tool_call(clients):
    oai, _ = clients
    r = oai.responses.create(
        model="m", input=uniq(), max_output_tokens=120, temperature=1.0,
        tools=[{"type": "function", "name": "get_time",
                "parameters": {"type": "object", "properties": {}}}], tool_choice="required")
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_time" for c in calls), r.output


def test_unusable_schema_is_400_naming_the_field(oai):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", input="hi", max_output_tokens=8, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
                "a": {"$ref": "#/$defs/missing"}}}}})
    assert e.value.body["param"].startswith("text.format")


def test_structured_outputs_speculate_as_batch_rows(qwen_dir):
    """A server with --prompt-lookup: greedy json_schema requests (a repetitive example in the
    prompt for the lookup to find) are speculating batch rows; their answers equal the same
    server's without lookup and follow the schema; /stats counts the drafts."""
    from openai import OpenAI
    example = json.dumps({"ids": [7, 7, 7], "color": "red"}) * 4
    answers, stats = [], None
    for lookup in (0, 2):
        s = start_server(qwen_dir, batch=4, prompt_cache_bytes=0, max_tokens=64,
                         prompt_lookup=lookup)
        try:
            oai = OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=120)

            def one(i):
                r = oai.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"{i} {example}"}],
                    max_tokens=60, temperature=0.0, response_format={
                        "type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}})
                return r.choices[0].message.content
            with ThreadPoolExecutor(3) as ex:
                answers.append(list(ex.map(one, range(3))))
            stats = httpx.get(s.url + "/stats", timeout=30).json()["speculation"]["lookup"]
        finally:
            stop_server(s)
    assert answers[0] == answers[1]
    for text in answers[1]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert stats["drafted"] > 0
