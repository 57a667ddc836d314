"""The Qwen equals-XML body of a tool call: one or more ``<function=name>`` blocks of
``<parameter=x>value</parameter>`` (read by both ``qwen3_coder`` and ``json_tools``).

Values: one leading and one trailing newline are removed (the template puts
the value on its own line), then the text is decoded against the param's
schema (``schema.decode_text``; a param with no schema stays a string).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

from engine.text.tools.base import MarkupError, ToolIndex
from engine.text.tools.schema import decode_text

FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_NAME = re.compile(r"\s*([^\s<>]+)\s*>")
_WS = re.compile(r"\s*")


def _unwrap_newlines(v: str) -> str:
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


def parse_functions(text: str, index: ToolIndex) -> List[Tuple[str, Dict[str, Any]]]:
    """``<function=…>…</function>`` blocks separated by whitespace, nothing else."""
    calls = []
    i = _WS.match(text).end()
    while i < len(text):
        if not text.startswith(FUNC_OPEN, i):
            raise MarkupError(f"expected {FUNC_OPEN!r} at {i}")
        m = _NAME.match(text, i + len(FUNC_OPEN))
        if not m:
            raise MarkupError("missing function name")
        name = m.group(1)
        props = index.check(name)
        i = m.end()
        args: Dict[str, Any] = {}
        while True:
            i = _WS.match(text, i).end()
            if text.startswith(FUNC_CLOSE, i):
                i += len(FUNC_CLOSE)
                break
            if not text.startswith(PARAM_OPEN, i):
                raise MarkupError(f"expected {PARAM_OPEN!r} or {FUNC_CLOSE!r} at {i}")
            pm = _NAME.match(text, i + len(PARAM_OPEN))
            if not pm:
                raise MarkupError("missing parameter name")
            end = text.find(PARAM_CLOSE, pm.end())
            if end == -1:
                raise MarkupError("unterminated parameter")
            key = pm.group(1)
            args[key] = decode_text(_unwrap_newlines(text[pm.end():end]), props.get(key))
            i = end + len(PARAM_CLOSE)
        calls.append((name, args))
        i = _WS.match(text, i).end()
    if not calls:
        raise MarkupError("no function in tool call")
    return calls
