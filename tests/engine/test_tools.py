"""engine.text.tools: per-format parsing, streaming withholding, chunking invariance,
and agreement with mlx-lm's own parsers on well-formed calls."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.text.tools import (FORMATS, ContentDelta, ToolCall, ToolCallRouter, get_tool_format,
                          parse_tool_calls)

HSET = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def counter_ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def parse(text, fmt, tools=None):
    return parse_tool_calls(text, fmt, tools, id_factory=counter_ids())


def stream(chunks, fmt, tools=None):
    r = ToolCallRouter(fmt, tools, id_factory=counter_ids())
    events = []
    for c in chunks:
        events += r.feed(c)
    events += r.finish()
    return events


def collapse(events):
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [e for e in events if isinstance(e, ToolCall)]


def tool(name, **props):
    return {"type": "function", "function": {
        "name": name, "description": "d",
        "parameters": {"type": "object", "properties": props}}}


WEATHER = [tool("get_weather", city={"type": "string"}, days={"type": "integer"},
                zip={"type": "string"}, temp={"type": "number"}, metric={"type": "boolean"},
                opts={"type": "object"}, tags={"type": "array", "items": {"type": "string"}},
                note={"type": ["string", "null"]}, any={"description": "untyped"}),
           tool("get_time", tz={"type": "string"})]


def one_call(text, fmt, tools=WEATHER):
    content, calls = parse(text, fmt, tools)
    assert len(calls) == 1, (content, calls)
    c = calls[0]
    assert json.loads(c.arguments_json) == c.arguments
    return content, c


# ----------------------------------------------------------------- registry

@pytest.mark.parametrize("name,want", [
    ("gemma4", "gemma4"), ("gemma4_text", "gemma4"), ("Gemma4-Text", "gemma4"),
    ("gemma4_unified", "gemma4"),
    ("minicpm", "minicpm5"), ("minicpm5", "minicpm5"),
    ("qwen2", "json_tools"), ("qwen3", "json_tools"), ("qwen3_moe", "json_tools"),
    ("llama", "json_tools"), ("hermes", "json_tools"), ("json_tools", "json_tools"),
    ("qwen3_5", "qwen3_coder"), ("qwen3_5_moe", "qwen3_coder"), ("qwen3_next", "qwen3_coder"),
    ("qwen3_coder", "qwen3_coder"),
])
def test_get_tool_format(name, want):
    assert get_tool_format(name).name == want
    assert get_tool_format(get_tool_format(name)) is FORMATS[want]


@pytest.mark.parametrize("name", ["gemma3", "llama4", "mistral", "", 3])
def test_get_tool_format_unknown(name):
    with pytest.raises(ValueError, match="no tool-call format|expected a model_type"):
        get_tool_format(name)


# ------------------------------------------------------------------- gemma 4

Q = '<|"|>'


def test_gemma4_basic_and_schema():
    text = ("Let me check.<|tool_call>call:get_weather{city:" + Q + "Paris, {FR} \"x\"" + Q
            + ",days:3,zip:02134,temp:-1.5e1,metric:true,note:null,"
            "opts:{units:" + Q + "C" + Q + ",deep:{a:[1,2,{b:null}]}},tags:[" + Q + "a" + Q + ","
            + Q + "b,c" + Q + "]}<tool_call|> Done.")
    content, c = one_call(text, "gemma4")
    assert content == "Let me check. Done."
    assert c.name == "get_weather" and c.id == "call_0"
    assert c.arguments == {"city": 'Paris, {FR} "x"', "days": 3, "zip": "02134", "temp": -15.0,
                           "metric": True, "note": None,
                           "opts": {"units": "C", "deep": {"a": [1, 2, {"b": None}]}},
                           "tags": ["a", "b,c"]}
    assert c.raw == text[len("Let me check."):-len(" Done.")]


def test_gemma4_string_params_that_look_numeric_or_json():
    text = ("<|tool_call>call:get_weather{city:12,zip:" + Q + "007" + Q + ",note:true,"
            "tz:1,days:" + Q + "4" + Q + ",any:7}<tool_call|>")
    _, c = one_call(text, "gemma4")
    # string-typed params keep the text; a quoted number for an integer param is decoded
    assert c.arguments == {"city": "12", "zip": "007", "note": "true", "tz": 1, "days": 4, "any": 7}
    _, c = one_call("<|tool_call>call:get_weather{opts:{a:1},zip:{a:1}}<tool_call|>", "gemma4")
    assert c.arguments == {"opts": {"a": 1}, "zip": '{"a": 1}'}


def test_gemma4_unicode_newlines_whitespace_and_keys():
    text = ("<|tool_call> call:get_time { tz : " + Q + "Europe/Zürich\n日本 🎉 <b>}" + Q
            + " , my-key:x , " + Q + "quoted key" + Q + ":1, } <tool_call|>")
    _, c = one_call(text, "gemma4", tools=None)
    assert c.arguments == {"tz": "Europe/Zürich\n日本 🎉 <b>}", "my-key": "x", "quoted key": 1}
    assert "Zürich" in c.arguments_json  # not \u-escaped


def test_gemma4_multiple_calls():
    one = "call:get_time{tz:" + Q + "UTC" + Q + "}"
    two = "call:get_weather{city:" + Q + "Oslo" + Q + "}"
    content, calls = parse("<|tool_call>" + one + two + "<tool_call|>", "gemma4", WEATHER)
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert calls[0].raw == calls[1].raw
    content, calls = parse("a<|tool_call>" + one + "<tool_call|>b<|tool_call>" + two + "<tool_call|>c",
                           "gemma4", WEATHER)
    assert content == "abc" and [c.id for c in calls] == ["call_0", "call_1"]


@pytest.mark.parametrize("bad", [
    "<|tool_call>call:get_time{tz:" + Q + "UTC}<tool_call|>",   # unterminated string
    "<|tool_call>call:get_time{tz:}<tool_call|>",              # missing value
    "<|tool_call>call:get_time{tz:1 junk<tool_call|>",        # unbalanced
    "<|tool_call>call:get_time{tz:1}trailing<tool_call|>",     # junk after the call
    "<|tool_call>get_time{tz:1}<tool_call|>",                  # no call:
    "<|tool_call><tool_call|>",                                # empty
    "<|tool_call>call:no_such_tool{a:1}<tool_call|>",          # unknown tool
])
def test_gemma4_invalid_markup_is_content(bad):
    text = "before " + bad + " after"
    assert parse(text, "gemma4", WEATHER) == (text, [])


def test_gemma4_unknown_name_accepted_without_tools():
    _, calls = parse("<|tool_call>call:anything{a:1}<tool_call|>", "gemma4", None)
    assert calls[0].name == "anything" and calls[0].arguments == {"a": 1}


# --------------------------------------------------------------- json_tools

def test_json_tools_variants():
    base = {"city": "Paris", "days": 3}
    for body in [
        {"name": "get_weather", "arguments": base},
        {"name": "get_weather", "parameters": base},
        {"function": {"name": "get_weather", "arguments": base}},
        {"name": "get_weather", "arguments": json.dumps(base)},
    ]:
        content, c = one_call("ok <tool_call>\n" + json.dumps(body) + "\n</tool_call>", "qwen3")
        assert content == "ok " and c.arguments == base and c.name == "get_weather"
    _, c = one_call('<tool_call>{"name": "get_time"}</tool_call>', "json_tools")
    assert c.arguments == {}


def test_json_tools_nested_coercion_unicode_and_raw_newlines():
    body = ('{"name": "get_weather", "arguments": {"zip": 2134, "days": "5", "opts": '
            '{"a": {"b": [1, {"c": "}"}]}}, "city": "Zürich\n\\"q\\" </x>", "tags": "[\\"x\\"]", '
            '"metric": "false", "temp": "2.5", "note": null, "extra": 1}}')
    _, c = one_call("<tool_call>" + body + "</tool_call>", "json_tools")
    assert c.arguments == {"zip": "2134", "days": 5, "opts": {"a": {"b": [1, {"c": "}"}]}},
                           "city": 'Zürich\n"q" </x>', "tags": ["x"], "metric": False,
                           "temp": 2.5, "note": None, "extra": 1}


def test_json_tools_several_calls_in_one_block_and_list():
    a = {"name": "get_time", "arguments": {"tz": "UTC"}}
    b = {"name": "get_weather", "arguments": {"city": "Rome"}}
    for body in [json.dumps(a) + "\n" + json.dumps(b), json.dumps([a, b])]:
        _, calls = parse("<tool_call>" + body + "</tool_call>", "json_tools", WEATHER)
        assert [c.name for c in calls] == ["get_time", "get_weather"]


@pytest.mark.parametrize("body", [
    '{"name": "get_time", "arguments": {"tz": "UTC"}',          # truncated JSON
    '{"name": "get_time", "arguments": [1]}',                   # arguments not an object
    '{"arguments": {}}',                                        # no name
    '{"name": "nope", "arguments": {}}',                        # unknown tool
    '{"name": "get_time", "arguments": "{not json"}',
    '{"name": "get_time"} trailing',
    '',
])
def test_json_tools_invalid_is_content(body):
    text = "x<tool_call>" + body + "</tool_call>y"
    assert parse(text, "json_tools", WEATHER) == (text, [])


# -------------------------------------------------------------- qwen3_coder

def test_qwen3_coder_equals_xml():
    text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n7\n</parameter>\n<parameter=zip>\n00501\n</parameter>\n"
            "<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
            "<parameter=temp>\n-0.5\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
            "<parameter=tags>\n['x', 'y']\n</parameter>\n<parameter=free>\n\n two lines\nhere \n\n</parameter>\n"
            "</function>\n</tool_call>")
    content, c = one_call(text, "qwen3_coder")
    assert content == "Checking.\n"
    assert c.arguments == {"city": "New York", "days": 7, "zip": "00501", "opts": {"a": [1, 2]},
                           "metric": True, "temp": -0.5, "note": None, "tags": ["x", "y"],
                           "free": "\n two lines\nhere \n"}


def test_qwen3_coder_string_stays_string_and_bodies():
    xml = "<function=get_weather><parameter=city>123</parameter><parameter=zip>{\"a\":1}</parameter></function>"
    _, c = one_call("<tool_call>" + xml + "</tool_call>", "qwen3_coder")
    assert c.arguments == {"city": "123", "zip": '{"a":1}'}
    # the bare form without the <tool_call> wrapper (Qwen3-Coder does emit it)
    content, c = one_call("pre " + xml + " post", "qwen3_coder")
    assert content == "pre  post" and c.arguments["city"] == "123"
    # json_tools does not treat a bare <function=…> as markup …
    assert parse("pre " + xml, "json_tools", WEATHER) == ("pre " + xml, [])
    # … but both read either body inside <tool_call>
    js = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    assert parse(js, "qwen3_coder", WEATHER)[1][0].arguments == {"tz": "UTC"}
    assert parse("<tool_call>" + xml + "</tool_call>", "json_tools", WEATHER)[1][0].name == "get_weather"
    # two functions in one block
    two = "<tool_call>" + xml + "\n<function=get_time><parameter=tz>UTC</parameter></function></tool_call>"
    assert [c.name for c in parse(two, "qwen3_coder", WEATHER)[1]] == ["get_weather", "get_time"]


@pytest.mark.parametrize("bad", [
    "<tool_call><function=get_time><parameter=tz>UTC</function></tool_call>",
    "<tool_call><function=get_time><parameter=tz>UTC</parameter></tool_call>",
    "<tool_call><function=get_time>junk</function></tool_call>",
    "<tool_call><function=>x</function></tool_call>",
    "<tool_call><function=nope></function></tool_call>",
])
def test_qwen3_coder_invalid_is_content(bad):
    assert parse(bad, "qwen3_coder", WEATHER) == (bad, [])


# ----------------------------------------------------------------- minicpm5

def test_minicpm5_xml_cdata_entities():
    text = ('Sure! <function name="get_weather"><param name="city"><![CDATA[a < b && </param> '
            '</function> <function name="x">\n]]></param>\n<param name=\'days\'> 12 </param>'
            '<param name=zip>02134</param><param name="note">A &amp; B &lt;3 &#233;&#x1F600; &bogus;</param>'
            '<param name="opts"> {"k": [1, null]} </param><param name="metric">false</param>'
            '<param name="temp">3</param><param name="tags"><![CDATA[["a<", "b"]]]></param>'
            '<param name="any">plain</param><param name="free">  x <![CDATA[ y ]]> z  </param>'
            '</function> bye')
    content, c = one_call(text, "minicpm")
    assert content == "Sure!  bye"
    assert c.arguments == {"city": 'a < b && </param> </function> <function name="x">\n',
                           "days": 12, "zip": "02134", "note": "A & B <3 é😀 &bogus;",
                           "opts": {"k": [1, None]}, "metric": False, "temp": 3,
                           "tags": ["a<", "b"], "any": "plain", "free": "x  y  z"}


def test_minicpm5_consecutive_calls_and_nulls():
    text = ('<function name="get_time"><param name="tz">null</param></function>\n'
            '<function name="get_weather"><param name="note">null</param>'
            '<param name="days">null</param></function>')
    content, calls = parse(text, "minicpm5", WEATHER)
    assert content == "\n"
    # string-only param keeps "null"; nullable and non-string params decode it
    assert calls[0].arguments == {"tz": "null"}
    assert calls[1].arguments == {"note": None, "days": None}


@pytest.mark.parametrize("bad", [
    '<function name="get_time"><param name="tz">UTC</function>',
    '<function name="get_time"><param name="tz"><![CDATA[UTC</param></function>',
    '<function name="get_time">stray<param name="tz">UTC</param></function>',
    '<function name="nope"></function>',
    '<function name=><param name="tz">UTC</param></function>',
])
def test_minicpm5_invalid_or_unterminated_is_content(bad):
    text = "a " + bad + " b"
    assert parse(text, "minicpm5", WEATHER) == (text, [])


# ------------------------------------------------------- streaming behaviour

def test_content_streams_live_and_markup_is_withheld():
    r = ToolCallRouter("qwen3", WEATHER, id_factory=counter_ids())
    assert r.feed("Hello, I will ") == [ContentDelta("Hello, I will ")]
    assert r.feed("check <tool") == [ContentDelta("check ")]       # "<tool" held back
    assert r.pending == "<tool" and not r.in_tool_call
    assert r.feed("_call>\n{\"name\": \"get_time\", ") == []        # markup withheld
    assert r.in_tool_call
    assert r.feed('"arguments": {"tz": "UTC"}}\n</tool') == []
    ev = r.feed("_call> and <b>bold</b> <t")
    assert ev[0].name == "get_time" and ev[0].arguments == {"tz": "UTC"}
    assert ev[1:] == [ContentDelta(" and <b>bold</b> ")]
    assert r.finish() == [ContentDelta("<t")]
    assert r.finish() == []
    assert [c.name for c in r.calls] == ["get_time"]
    with pytest.raises(RuntimeError):
        r.feed("x")


def test_hold_back_releases_when_not_a_marker():
    r = ToolCallRouter("gemma4", None)
    assert r.feed("a <|tool_") == [ContentDelta("a ")]
    assert r.feed("callx") == [ContentDelta("<|tool_callx")]
    assert r.feed("<") == [] and r.finish() == [ContentDelta("<")]


def test_unterminated_markup_released_at_finish():
    r = ToolCallRouter("json_tools", WEATHER)
    assert r.feed('x <tool_call>{"name": "get_time", "arguments": {}}') == [ContentDelta("x ")]
    assert r.finish() == [ContentDelta('<tool_call>{"name": "get_time", "arguments": {}}')]


def test_reopened_marker_abandons_the_earlier_one():
    text = 'a <tool_call> oops <tool_call>{"name": "get_time", "arguments": {}}</tool_call> b'
    content, calls = parse(text, "json_tools", WEATHER)
    assert content == "a <tool_call> oops  b" and calls[0].name == "get_time"
    # MiniCPM: an opener inside CDATA is not a reopen
    text = '<function name="get_time"><param name="tz"><![CDATA[<function name="x">]]></param></function>'
    assert parse(text, "minicpm5", WEATHER)[1][0].arguments == {"tz": '<function name="x">'}


def test_passthrough_and_ids():
    assert parse("<tool_call>{}</tool_call>", None) == ("<tool_call>{}</tool_call>", [])
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2, "qwen3")
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_") and len(calls[0].id) == 29


def test_tools_forms_accepted():
    flat = [{"name": "get_time", "parameters": {"properties": {"tz": {"type": "string"}}}}]
    anthropic = [{"name": "get_time", "input_schema": {"properties": {"tz": {"type": "string"}}}}]
    for tools in (flat, anthropic):
        _, calls = parse('<tool_call>{"name": "get_time", "arguments": {"tz": 5}}</tool_call>',
                         "qwen3", tools)
        assert calls[0].arguments == {"tz": "5"}
    with pytest.raises(ValueError):
        ToolCallRouter("qwen3", [{"type": "function", "function": {}}])


# --------------------------------------------- generated documents (hypothesis)

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
FLOATS = st.one_of(  # non-integral floats (mlx-lm reads 2.0 back as 2)
    st.floats(-1e9, 1e9).map(lambda f: f + 0.25 if f.is_integer() else f),
    st.sampled_from([1e-05, -3.5e-200, 0.1, 123456.789e-10]))
FORBIDDEN = ("<tool_call>", "</tool_call>", "<|tool_call>", "<tool_call|>", Q, "<function",
             "</function>", "</param>", "</parameter>", "<parameter=", "<param ", "]]>", "<![CDATA[")


def clean(s):
    return not any(f in s for f in FORBIDDEN)


STRINGS = TEXT.filter(clean)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), FLOATS, STRINGS)
NESTED = st.recursive(SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(KEYS, kids, max_size=3)), max_leaves=6)

# (schema type, value strategy) for top-level params
PARAM = st.one_of(
    st.tuples(st.just("string"), STRINGS),
    st.tuples(st.just("integer"), st.integers(-10**12, 10**12)),
    st.tuples(st.just("number"), FLOATS),
    st.tuples(st.just("boolean"), st.booleans()),
    st.tuples(st.just("object"), st.dictionaries(KEYS, NESTED, max_size=3)),
    st.tuples(st.just("array"), st.lists(NESTED, max_size=3)),
)
CALL = st.tuples(NAMES, st.dictionaries(KEYS, PARAM, max_size=4))


def tools_for(calls):
    by_name = {}
    for name, params in calls:
        by_name.setdefault(name, {}).update({k: {"type": t} for k, (t, _) in params.items()})
    return [tool(n, **p) for n, p in by_name.items()]


def consistent(calls):
    """One schema per (tool, param) across the document."""
    seen = {}
    for name, params in calls:
        for k, (t, _) in params.items():
            if seen.setdefault((name, k), t) != t:
                return False
    return True


def gemma_value(v):
    if isinstance(v, str):
        return Q + v + Q
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{gemma_value(x)}" for k, x in sorted(v.items())) + "}"
    if isinstance(v, list):
        return "[" + ",".join(gemma_value(x) for x in v) + "]"
    return repr(v) if isinstance(v, float) else str(v)


def text_value(t, v):
    if t == "string":
        return v
    if t == "number":
        return repr(v)
    return json.dumps(v, ensure_ascii=False)


def render(fmt, name, params):
    if fmt == "gemma4":
        return "<|tool_call>call:" + name + gemma_value({k: v for k, (_, v) in params.items()}) + "<tool_call|>"
    if fmt == "json_tools":
        return ("<tool_call>\n" + json.dumps({"name": name, "arguments": {k: v for k, (_, v) in params.items()}},
                                             ensure_ascii=False) + "\n</tool_call>")
    if fmt == "qwen3_coder":
        body = "".join(f"<parameter={k}>\n{text_value(t, v)}\n</parameter>\n" for k, (t, v) in params.items())
        return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"
    if fmt == "minicpm5":
        out = f'<function name="{name}">'
        for k, (t, v) in params.items():
            s = text_value(t, v)
            if s != s.strip() or any(c in s for c in "<&\n") or not s:
                s = "<![CDATA[" + s + "]]>"
            out += f'<param name="{k}">{s}</param>'
        return out + "</function>"
    raise AssertionError(fmt)


FMTS = ["gemma4", "json_tools", "qwen3_coder", "minicpm5"]
FILLER = st.one_of(STRINGS, st.sampled_from(["<", "<tool", "<|tool_call", "<function name", "\n",
                                            "</tool_call>", "<tool_call|>", "}", "<function", "<p"]))


def no_opener(fmt, s):
    return not any(o in s for o, _ in FORMATS[fmt].markers)


@st.composite
def valid_doc(draw, fmt):
    """[(kind, payload)] alternating content and valid calls."""
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        parts.append(("content", draw(st.lists(FILLER, max_size=3).map("".join))))
        parts.append(("call", draw(CALL)))
    parts.append(("content", draw(st.lists(FILLER, max_size=3).map("".join))))
    return parts


@st.composite
def chunking(draw, text):
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def expected_args(fmt, params):
    return {k: v for k, (_, v) in params.items()}


@pytest.mark.parametrize("fmt", FMTS)
@HSET
@given(data=st.data())
def test_property_valid_markup_never_leaks_and_any_chunking_agrees(fmt, data):
    parts = data.draw(valid_doc(fmt))
    calls = [p for k, p in parts if k == "call"]
    assume(consistent(calls))
    content_want = "".join(p for k, p in parts if k == "content")
    assume(no_opener(fmt, content_want))
    text = "".join(p if k == "content" else render(fmt, *p) for k, p in parts)
    tools = tools_for(calls) if data.draw(st.booleans()) or fmt in ("qwen3_coder", "minicpm5") else None
    content, got = parse(text, fmt, tools)
    assert content == content_want
    assert [(c.name, c.arguments) for c in got] == [(n, expected_args(fmt, p)) for n, p in calls]
    for c in got:
        assert json.loads(c.arguments_json) == c.arguments
    chunks = data.draw(chunking(text))
    events = stream(chunks, fmt, tools)
    assert collapse(events) == (content, got)
    # markup is never emitted, even partially: every content event is a piece of content_want
    streamed = [e.text for e in events if isinstance(e, ContentDelta)]
    assert all(streamed) and "".join(streamed) == content_want


MARKUPISH = {
    "gemma4": ["<|tool_call>", "<tool_call|>", "call:", "{", "}", Q, ":", ",", "a", "1", "[", "]"],
    "json_tools": ["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"f"',
                   "<function=", "</function>", "\n"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "f>", "</function>", "<parameter=",
                    "x>", "</parameter>", "1", "\n"],
    "minicpm5": ['<function name="f">', "</function>", '<param name="x">', "</param>", "<![CDATA[",
                 "]]>", "&amp;", "1", "<"],
}


@pytest.mark.parametrize("fmt", FMTS)
@HSET
@given(data=st.data())
def test_property_chunking_never_changes_the_result(fmt, data):
    """Arbitrary soups of marker fragments, valid calls and text (valid or not,
    terminated or not): streaming in any chunks == the one-shot parse, and no
    character is lost or invented."""
    pieces = data.draw(st.lists(st.one_of(st.sampled_from(MARKUPISH[fmt]), FILLER,
                                          CALL.map(lambda c: render(fmt, *c))), max_size=14))
    text = "".join(pieces)
    tools = None if data.draw(st.booleans()) else [tool("f", x={"type": "integer"})]
    content, calls = parse(text, fmt, tools)
    assert collapse(stream(data.draw(chunking(text)), fmt, tools)) == (content, calls)
    assert collapse(stream(list(text), fmt, tools)) == (content, calls)  # char by char
    # conservation: the content pieces and the calls' markup rebuild the text, in order
    rebuilt, events = [], parse_events(text, fmt, tools)
    i = 0
    while i < len(events):
        e = events[i]
        if isinstance(e, ContentDelta):
            rebuilt.append(e.text)
            i += 1
        else:
            rebuilt.append(e.raw)
            i += len(parse(e.raw, fmt, tools)[1])
    assert "".join(rebuilt) == text
    if not calls:
        assert content == text


def parse_events(text, fmt, tools):
    r = ToolCallRouter(fmt, tools, id_factory=counter_ids())
    return r.feed(text) + r.finish()


# ----------------------------------------------- agreement with mlx-lm parsers

@pytest.mark.parity
@HSET
@given(call=CALL)
def test_oracle_gemma4(call):
    from mlx_lm.tool_parsers import gemma4 as ref

    name, params = call
    markup = render("gemma4", name, params)
    want = ref.parse_tool_call(markup[len(ref.tool_call_start):-len(ref.tool_call_end)])
    _, got = parse(markup, "gemma4", None)
    assert [(c.name, c.arguments) for c in got] == [(want["name"], want["arguments"])]


@pytest.mark.parity
@HSET
@given(call=CALL)
def test_oracle_json_tools(call):
    from mlx_lm.tool_parsers import json_tools as ref

    name, params = call
    markup = render("json_tools", name, params)
    want = ref.parse_tool_call(markup[len(ref.tool_call_start):-len(ref.tool_call_end)])
    _, got = parse(markup, "json_tools", None)
    assert [(c.name, c.arguments) for c in got] == [(want["name"], want["arguments"])]


def _oracle_ok(params):
    # mlx-lm turns the text "null" into None even for string params, and its
    # number decoding turns 2.0 into 2; keep those out of the agreement check
    return all(not (t == "string" and v.strip().lower() == "null") for t, v in params.values())


@pytest.mark.parity
@HSET
@given(call=CALL)
def test_oracle_qwen3_coder(call):
    from mlx_lm.tool_parsers import qwen3_coder as ref

    name, params = call
    assume(_oracle_ok(params))
    # mlx-lm strips the newlines around a value only once, as we do, but reads
    # object/array values with json.loads only: keep to JSON-typed values
    markup = render("qwen3_coder", name, params)
    tools = tools_for([call])
    want = ref.parse_tool_call(markup[len(ref.tool_call_start):-len(ref.tool_call_end)], tools)
    _, got = parse(markup, "qwen3_coder", tools)
    assert [(c.name, c.arguments) for c in got] == [(want["name"], want["arguments"])]


@pytest.mark.parity
@HSET
@given(call=CALL)
def test_oracle_minicpm5(call):
    from mlx_lm.tool_parsers import minicpm5 as ref

    name, params = call
    assume(_oracle_ok(params))
    markup = render("minicpm5", name, params)
    tools = tools_for([call])
    want = ref.parse_tool_call(markup, tools)
    _, got = parse(markup, "minicpm5", tools)
    assert [(c.name, c.arguments) for c in got] == [(want["name"], want["arguments"])]


def test_engine_tools_import_no_oracle():
    import ast
    import pathlib

    import engine.text.tools

    for path in pathlib.Path(engine.text.tools.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in mods if m.split(".")[0] in ("mlx_lm", "optiq", "transformers")], path


# ------------------------------------------- format chosen from the chat template

@pytest.mark.parametrize("fixture,model_type,want", [
    ("minicpm5_llama", "llama", "minicpm5"),   # MiniCPM5 checkpoints are model_type llama
    ("minicpm", "minicpm", "minicpm5"),
    ("qwen3", "qwen3", "json_tools"),
    ("gemma4", "gemma4", "gemma4"),
    ("llama", "llama", "json_tools"),         # no template format: from model_type
])
def test_tool_format_from_template_then_model_type(fixture, model_type, want):
    from engine.loader import read_config
    from engine.text.tokenizer import load_tokenizer
    from engine.text.tools import tool_format_for
    from starter.models import ensure_fixture
    path = ensure_fixture(fixture)
    assert read_config(path)["model_type"] == model_type
    assert tool_format_for(load_tokenizer(path), model_type).name == want
    assert tool_format_for(None, "mistral") is None and tool_format_for() is None


def test_llama_typed_minicpm5_fixture_calls_and_thinks():
    """The llama-typed MiniCPM5 fixture: its forced call is MiniCPM5 XML that the
    chosen parser reads back, and its reasoning format is MiniCPM5's."""
    import engine
    from engine.constrained import ToolChoice, tool_choice_processor
    from engine.text.reasoning import reasoning_format_for
    from engine.text.tools import tool_format_for
    from starter.models import ensure_fixture
    model, tok = engine.load(ensure_fixture("minicpm5_llama"))
    fmt = tool_format_for(tok, "llama")
    assert reasoning_format_for(tok).name == "minicpm5"
    proc = tool_choice_processor(tok, fmt, WEATHER[1:], ToolChoice("function", "get_time"),
                                 parallel=False)
    r = engine.generate(model, tok, [{"role": "user", "content": "time?"}], tools=WEATHER[1:],
                        max_tokens=200, temperature=0.0, logits_processors=[proc])
    assert r.finish_reason == "stop" and r.text.startswith('<function name="get_time">'), r.text
    content, calls = parse_tool_calls(r.text, fmt, WEATHER[1:])
    assert [c.name for c in calls] == ["get_time"] and content == ""
    # the model_type alone would have picked the wrong parser
    assert parse_tool_calls(r.text, get_tool_format("llama"), WEATHER[1:])[1] == []
