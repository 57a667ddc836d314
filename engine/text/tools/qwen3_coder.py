"""Qwen equals-XML tool calls (Qwen3-Coder, Qwen3.5 / Qwen3-Next templates)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A ``<tool_call>`` block may hold one or more ``<function=…>`` blocks, or the
JSON body of the ``json_tools`` format (the body's first character decides).
Qwen3-Coder sometimes drops the ``<tool_call>`` wrapper (mlx-lm PR #1616), so
a bare ``<function=…>…</function>`` is markup too in this format.

Values: one leading and one trailing newline are removed (the template puts
the value on its own line), then the text is decoded against the param's
schema (``schema.decode_text``; a param with no schema stays a string).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from engine.text.tools import json_tools
from engine.text.tools.base import ToolFormat, ToolIndex
from engine.text.tools.equals_xml import FUNC_CLOSE, FUNC_OPEN, PARAM_CLOSE, PARAM_OPEN, parse_functions

__all__ = ["FORMAT", "FUNC_CLOSE", "FUNC_OPEN", "PARAM_CLOSE", "PARAM_OPEN", "parse",
           "parse_functions"]


def parse(markup: str, index: ToolIndex) -> List[Tuple[str, Dict[str, Any]]]:
    if markup.startswith(FUNC_OPEN):
        return parse_functions(markup, index)
    return json_tools.parse(markup, index)


FORMAT = ToolFormat(
    name="qwen3_coder",
    markers=(("<tool_call>", "</tool_call>"), (FUNC_OPEN, FUNC_CLOSE)),
    parse=parse,
    description="Qwen equals-XML: <tool_call><function=name><parameter=x>v</parameter></function></tool_call>",
)
