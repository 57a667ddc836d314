"""Known request fields with values the server cannot honour are a 400 naming
`param` (official openai SDK and raw HTTP), never a silent 200."""

import httpx
import openai
import pytest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "hi"}]


def _bad(oai, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", max_tokens=2, **kw)
    return e.value.body


@pytest.mark.parametrize("fmt,param", [
    ({"type": "nonsense"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}},
     "response_format.schema"),
])
def test_unknown_response_format_is_400(oai, fmt, param):
    body = _bad(oai, messages=USER, response_format=fmt)
    assert body["param"] == param


def test_tool_choice_naming_a_missing_tool_is_400(oai):
    body = _bad(oai, messages=USER, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}})
    assert body["param"] == "tool_choice" and "nope" in body["message"]


def test_tool_choice_required_without_tools_is_400(oai):
    assert _bad(oai, messages=USER, tool_choice="required")["param"] == "tool_choice"


def test_n_above_one_is_400(oai):
    assert _bad(oai, messages=USER, n=2)["param"] == "n"


@pytest.mark.parametrize("msg", [{"role": "user"}, {"role": "user", "content": None},
                                 {"role": "assistant", "content": None}])
def test_message_without_content_is_400(oai, msg):
    assert _bad(oai, messages=[*USER, msg] if msg["role"] == "assistant" else [msg])["param"] \
        == "messages"


def test_accepted_values_still_work(srv, oai):
    """The checks only refuse: text / json_object formats, a valid named tool, an
    assistant message with tool calls and no content are all accepted."""
    tc = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": "{}"}}
    for kw in ({"response_format": {"type": "text"}},
               {"response_format": {"type": "json_object"}},
               {"tools": TOOLS, "tool_choice": {"type": "function",
                                                "function": {"name": "get_weather"}}},
               {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [tc]},
                             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}):
        kw.setdefault("messages", USER)
        r = oai.chat.completions.create(model="m", max_tokens=2, **kw)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_completions_unknown_response_format_is_400(srv):
    r = httpx.post(srv.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2,
                                                  "response_format": {"type": "xml"}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"


A_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]


def test_anthropic_tool_choice_naming_a_missing_tool_is_400(claude):
    import anthropic
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=2, messages=USER, tools=A_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    assert "nope" in str(e.value)
    ok = claude.messages.create(model="m", max_tokens=2, messages=USER, tools=A_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"})
    assert ok.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("kw,param", [
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
      "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_responses_checks_are_400(oai, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", input="hi", max_output_tokens=16, **kw)
    assert e.value.body["param"] == param


def test_responses_accepts_a_json_schema_format(oai):
    r = oai.responses.create(model="m", input="hi", max_output_tokens=16, text={"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}})
    assert r.status in ("completed", "incomplete")


@pytest.mark.parametrize("content", [[5], [{"type": "output_text", "text": 3}],
                                     [{"type": "input_audio"}], [{"type": "video"}], 7])
def test_bad_content_parts_name_their_field(srv, content):
    """A bad content part is a 400 naming the field it came from: `messages` on chat
    completions, `input` on Responses (a message's content or a tool output's parts)."""
    r = httpx.post(srv.v1 + "/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    for item in ({"role": "user", "content": content},
                 {"type": "function_call_output", "call_id": "c", "output": content},
                 {"type": "custom_tool_call_output", "call_id": "c", "output": content}):
        r = httpx.post(srv.v1 + "/responses", timeout=60, json={"input": [item]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", (item, r.text)
