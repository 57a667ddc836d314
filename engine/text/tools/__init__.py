"""Tool-call parsing: per-family formats and a streaming router.

    fmt = get_tool_format("qwen3")                 # model_type, family or format name
    router = ToolCallRouter(fmt, tools)            # OpenAI function tools (or None)
    for delta in text_deltas:
        for ev in router.feed(delta):
            ...                                    # ContentDelta(text) | ToolCall(...)
    events = router.finish()

    content, calls = parse_tool_calls(text, fmt, tools)   # same result, one shot

Formats (named like mlx-lm's ``tool_parser_type``): ``gemma4`` (native
``<|tool_call>`` sentinels), ``minicpm5`` (``<function name=…>`` XML with
CDATA), ``json_tools`` (``<tool_call>{json}</tool_call>``), ``qwen3_coder``
(``<tool_call><function=…>`` equals-XML). See docs/tool-calls.md.
"""

from __future__ import annotations

from engine.text.tools.base import ContentDelta, Event, MarkupError, ToolCall, ToolFormat, ToolIndex
from engine.text.tools.formats import FORMATS, get_tool_format, tool_format_for
from engine.text.tools.router import ToolCallRouter, new_call_id, parse_tool_calls
from engine.text.tools.schema import coerce_typed, decode_text, schema_types

__all__ = [
    "ContentDelta", "ToolCall", "Event", "ToolFormat", "ToolIndex", "MarkupError",
    "ToolCallRouter", "parse_tool_calls", "get_tool_format", "tool_format_for", "new_call_id",
    "FORMATS",
    "decode_text", "coerce_typed", "schema_types",
]
