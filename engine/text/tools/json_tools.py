"""JSON tool calls in ``<tool_call>`` tags (Qwen2.5/Qwen3 and Hermes-style Llama)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    </tool_call>

The body is one or more JSON values (objects, or lists of objects) separated
by whitespace. Each object is ``{"name", "arguments"}``; also accepted:
``"parameters"`` for ``"arguments"`` (Llama 3), ``{"function": {...}}``
nesting, and ``arguments`` given as a JSON-encoded string. Control characters
inside strings (raw newlines in code) are tolerated. A body that starts with
``<function=`` is read as the Qwen equals-XML form instead (see qwen3_coder).

Arguments are already typed; ``schema.coerce_typed`` makes a string-only param
a string (``5`` -> ``"5"``) and decodes a string given for a non-string param.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

from engine.text.tools.base import MarkupError, ToolFormat, ToolIndex
from engine.text.tools.equals_xml import FUNC_OPEN, parse_functions
from engine.text.tools.schema import coerce_typed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder(strict=False)


def _call(obj: Any, index: ToolIndex) -> Tuple[str, Dict[str, Any]]:
    if not isinstance(obj, dict):
        raise MarkupError("a tool call must be a JSON object")
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    name = obj.get("name")
    props = index.check(name)
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = _JSON.decode(args) if args.strip() else {}
        except ValueError as e:
            raise MarkupError("arguments string is not JSON") from e
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise MarkupError("arguments must be a JSON object")
    return name, {k: coerce_typed(v, props.get(k)) for k, v in args.items()}


def parse_json_body(body: str, index: ToolIndex) -> List[Tuple[str, Dict[str, Any]]]:
    calls, i = [], 0
    body = body.strip()
    while i < len(body):
        try:
            value, i = _JSON.raw_decode(body, i)
        except (ValueError, RecursionError) as e:
            raise MarkupError(f"bad JSON in tool call: {e}") from e
        for obj in value if isinstance(value, list) else [value]:
            calls.append(_call(obj, index))
        while i < len(body) and body[i].isspace():
            i += 1
    if not calls:
        raise MarkupError("empty tool call")
    return calls


def parse(markup: str, index: ToolIndex) -> List[Tuple[str, Dict[str, Any]]]:
    if not (markup.startswith(OPEN) and markup.endswith(CLOSE)):
        raise MarkupError("not a <tool_call> block")
    body = markup[len(OPEN):len(markup) - len(CLOSE)]
    if body.lstrip().startswith(FUNC_OPEN):
        return parse_functions(body, index)
    return parse_json_body(body, index)


FORMAT = ToolFormat(
    name="json_tools",
    markers=((OPEN, CLOSE),),
    parse=parse,
    description='JSON in tags: <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
)
