"""A tool call cut off by the token limit (`ToolCallRouter.finish(cut=True)`,
engine.text.tools.cut): its name and only the arguments complete before the cut, on every
format; nothing when the name was cut; the raw markup never as content; the same in any
chunking. `finish()` without `cut` still gives unterminated markup back as content."""

from __future__ import annotations

import json

import pytest

from engine.text.reasoning import ChatOutputParser
from engine.text.tools import ContentDelta, ToolCall, ToolCallRouter

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"},
                                     "timeout": {"type": "integer"}, "opts": {"type": "object"}}}}}]

# (format, the text the limit cut, the cut call's arguments; None: no call)
CASES = [
    ("json_tools", '<tool_call>\n{"name": "bash", "arguments": {"timeout": 5, "command": "rm -rf /tmp/bu',
     {"timeout": 5}),
    ("json_tools", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls, -l", "opts": {"a": 1, "b"',
     {"command": "ls, -l"}),
    ("json_tools", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls", "timeout": 12',
     {"command": "ls"}),        # 12 could have been 120
    ("json_tools", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}', {"command": "ls"}),
    ("json_tools", '<tool_call>\n{"name": "bash", "arguments": {', {}),
    ("json_tools", '<tool_call>\n{"name": "ba', None),
    ("json_tools", '<tool_call>\n{"name": "rm", "arguments": {"command": "ls",', None),   # unknown tool
    ("json_tools", '<tool_call>\n', None),
    ("json_tools", '<tool_call>\n<function=bash>\n<parameter=timeout>\n5\n</parameter>\n'
                   '<parameter=command>\nls -', {"timeout": 5}),
    ("qwen3_coder", '<tool_call>\n<function=bash>\n<parameter=timeout>\n5\n</parameter>\n'
                    '<parameter=command>\nls -', {"timeout": 5}),
    ("qwen3_coder", '<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>',
     {"command": "ls"}),
    ("qwen3_coder", '<tool_call>\n<function=bash>\n<para', {}),
    ("qwen3_coder", '<tool_call>\n<function=ba', None),
    ("minicpm5", '<function name="bash"><param name="timeout">5</param><param name="command">ls',
     {"timeout": 5}),
    ("minicpm5", '<function name="bash"><param name="command"><![CDATA[a </param> b', {}),
    ("gemma4", '<|tool_call>call:bash{timeout:5,command:<|"|>ls, -l', {"timeout": 5}),
    ("gemma4", '<|tool_call>call:bash{command:<|"|>ls, -l<|"|>,timeout:7', {"command": "ls, -l"}),
    ("gemma4", '<|tool_call>call:bash{command:<|"|>ls<|"|>}', {"command": "ls"}),
    ("gemma4", '<|tool_call>call:ba', None),
    # the closing marker itself cut short: every argument was complete
    ("json_tools", '<tool_call>\n{"name": "bash", "arguments": {"command": "rm -rf /tmp/x"}}\n</tool_ca',
     {"command": "rm -rf /tmp/x"}),
    ("gemma4", '<|tool_call>call:bash{command:<|"|>ls<|"|>}<tool_ca', {"command": "ls"}),
    # the opening marker cut short: neither a call nor text
    ("json_tools", '<tool_c', None),
    ("minicpm5", '<function name', None),
]


def _run(fmt, chunks, cut=True):
    r = ToolCallRouter(fmt, TOOLS, id_factory=lambda: "call_x")
    events = [e for c in chunks for e in r.feed(c)] + r.finish(cut=cut)
    return ("".join(e.text for e in events if isinstance(e, ContentDelta)),
            [e for e in events if isinstance(e, ToolCall)])


@pytest.mark.parametrize("fmt,text,args", CASES)
def test_cut_call_keeps_only_complete_arguments(fmt, text, args):
    content, calls = _run(fmt, ["Sure. " + text])
    assert content == "Sure. "                  # the markup is never content
    if args is None:
        assert calls == []
    else:
        [call] = calls
        assert (call.name, call.arguments, call.cut) == ("bash", args, True)
        assert call.arguments_json == json.dumps(args)[:-1]     # (left open: never parses)
        with pytest.raises(ValueError):
            json.loads(call.arguments_json)


@pytest.mark.parametrize("fmt,text,args", CASES)
def test_any_chunking_gives_the_same_cut(fmt, text, args):
    whole = _run(fmt, ["Sure. " + text])
    s = "Sure. " + text
    for size in (1, 2, 5):
        assert _run(fmt, [s[i:i + size] for i in range(0, len(s), size)]) == whole


@pytest.mark.parametrize("fmt,text,args", CASES[:3])
def test_without_cut_unterminated_markup_stays_content(fmt, text, args):
    # (a stop for another reason than the limit: the text is what it was)
    assert _run(fmt, ["Sure. " + text], cut=False) == ("Sure. " + text, [])


def test_complete_calls_before_a_cut_one_are_whole():
    text = ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "bash", "arguments": {"command": "pw')
    content, calls = _run("json_tools", [text])
    assert [(c.arguments, c.cut) for c in calls] == [({"command": "ls"}, False), ({}, True)]
    assert content == "\n"


def test_chat_parser_passes_the_cut_through_reasoning():
    p = ChatOutputParser("qwen3", "json_tools", TOOLS, id_factory=lambda: "call_x")
    events = p.feed('<think>hm</think>Ok <tool_call>\n{"name": "bash", "arguments": '
                    '{"timeout": 3, "command": "x') + p.finish(cut=True)
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.arguments, c.cut) for c in calls] == [({"timeout": 3}, True)]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Ok "
