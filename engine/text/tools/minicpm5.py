"""MiniCPM5 attribute-XML tool calls, no outer wrapper::

    <function name="get_weather"><param name="city">Paris</param>
    <param name="query"><![CDATA[a < b && c]]></param></function>

Parallel calls are consecutive ``<function>`` blocks. The name attributes may
be double-quoted, single-quoted or bare. A value is XML character data:
``<![CDATA[…]]>`` sections are taken verbatim (a ``</param>`` or
``</function>`` inside CDATA does not end anything), the text outside them has
the XML entities (``&lt; &gt; &amp; &quot; &apos; &#N; &#xH;``) decoded, and
whitespace around the whole value is trimmed unless it is inside CDATA. Then
the text is decoded against the param's schema (``schema.decode_text``; a
param with no schema stays a string).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from engine.text.tools.base import Markers, MarkupError, ToolFormat, ToolIndex
from engine.text.tools.schema import decode_text

OPEN, CLOSE = "<function name=", "</function>"
CDATA_OPEN, CDATA_CLOSE = "<![CDATA[", "]]>"
_ATTR = r"""\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'<>/]+))\s*>"""
_FUNC = re.compile(r"<function\s+name" + _ATTR)
_PARAM = re.compile(r"<param\s+name" + _ATTR)
_PARAM_CLOSE = "</param>"
_WS = re.compile(r"\s*")
_ENTITY = re.compile(r"&(lt|gt|amp|quot|apos|#[0-9]+|#x[0-9a-fA-F]+);")
_NAMED = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}


def _entity(m: re.Match) -> str:
    e = m.group(1)
    if e in _NAMED:
        return _NAMED[e]
    try:
        return chr(int(e[2:], 16) if e[1] == "x" else int(e[1:]))
    except (ValueError, OverflowError):
        return m.group()


def _find_outside_cdata(text: str, needles: Tuple[str, ...], start: int) -> Optional[Tuple[int, str]]:
    """First (index, needle) of any needle at/after ``start`` that is not in a
    CDATA section; None if there is none (or a CDATA section is unterminated)."""
    i = start
    while True:
        hits = [(text.find(n, i), n) for n in needles + (CDATA_OPEN,)]
        hits = [h for h in hits if h[0] != -1]
        if not hits:
            return None
        j, n = min(hits)
        if n != CDATA_OPEN:
            return j, n
        k = text.find(CDATA_CLOSE, j + len(CDATA_OPEN))
        if k == -1:
            return None
        i = k + len(CDATA_CLOSE)


def scan(buf: str, markers: Markers) -> Optional[Tuple[str, int]]:
    open_, close = markers
    hit = _find_outside_cdata(buf, (close, open_), len(open_))
    if hit is None:
        return None
    j, n = hit
    return ("close", j + len(close)) if n == close else ("reopen", j)


def _value(raw: str) -> str:
    parts: List[Tuple[bool, str]] = []  # (is_cdata, text)
    i = 0
    while True:
        j = raw.find(CDATA_OPEN, i)
        if j == -1:
            parts.append((False, raw[i:]))
            break
        k = raw.find(CDATA_CLOSE, j + len(CDATA_OPEN))
        if k == -1:
            raise MarkupError("unterminated CDATA")
        parts.append((False, raw[i:j]))
        parts.append((True, raw[j + len(CDATA_OPEN):k]))
        i = k + len(CDATA_CLOSE)
    if not parts[0][0]:
        parts[0] = (False, parts[0][1].lstrip())
    if not parts[-1][0]:
        parts[-1] = (False, parts[-1][1].rstrip())
    return "".join(t if cdata else _ENTITY.sub(_entity, t) for cdata, t in parts)


def _attr(m: re.Match) -> str:
    return next(g for g in m.groups() if g is not None)


def parse(markup: str, index: ToolIndex) -> List[Tuple[str, Dict[str, Any]]]:
    m = _FUNC.match(markup)
    if not m or not markup.endswith(CLOSE):
        raise MarkupError("not a MiniCPM <function> block")
    name = _attr(m)
    props = index.check(name)
    args: Dict[str, Any] = {}
    i = m.end()
    while True:
        i = _WS.match(markup, i).end()
        if markup.startswith(CLOSE, i):
            if i + len(CLOSE) != len(markup):
                raise MarkupError("text after </function>")
            break
        pm = _PARAM.match(markup, i)
        if not pm:
            raise MarkupError(f"expected <param name=…> or </function> at {i}")
        hit = _find_outside_cdata(markup, (_PARAM_CLOSE,), pm.end())
        if hit is None:
            raise MarkupError("unterminated <param>")
        key = _attr(pm)
        args[key] = decode_text(_value(markup[pm.end():hit[0]]), props.get(key))
        i = hit[0] + len(_PARAM_CLOSE)
    return [(name, args)]


FORMAT = ToolFormat(
    name="minicpm5",
    markers=((OPEN, CLOSE),),
    parse=parse,
    scan=scan,
    description='MiniCPM5: <function name="f"><param name="p">value or <![CDATA[...]]></param></function>',
)
