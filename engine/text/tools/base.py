"""Events, the format descriptor and the tool index shared by every format."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

Markers = Tuple[str, str]  # (opening marker, closing marker)


class MarkupError(ValueError):
    """A complete piece of tool-call markup that is not a valid call."""


@dataclass(frozen=True)
class ContentDelta:
    """Plain assistant text, to stream as ``delta.content``."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One tool call. ``arguments_json`` is ``json.dumps(arguments)``
    (non-ASCII kept), what OpenAI's ``function.arguments`` carries; ``raw`` is
    the markup the call was parsed from (several calls may share one markup).
    ``cut``: the token limit ended the call before its markup did (see
    engine.text.tools.cut): ``arguments`` holds only those complete before the cut, and
    ``arguments_json`` is their JSON without its closing brace (it does not parse: a client
    that runs any call whose arguments parse must not run this one)."""

    id: str
    name: str
    arguments: Dict[str, Any]
    arguments_json: str
    raw: str = field(default="", compare=True)
    cut: bool = False


Event = Any  # ContentDelta | ToolCall


class ToolIndex:
    """name -> JSON schema of its parameters' properties, from OpenAI tools.

    Accepts ``{"type": "function", "function": {name, parameters}}``, the flat
    ``{name, parameters}`` (Responses API) and ``{name, input_schema}``
    (Anthropic). ``None`` or ``[]`` means no tools are known: any name is
    accepted and no argument has a schema.
    """

    def __init__(self, tools: Optional[Sequence[dict]] = None):
        self.properties: Optional[Dict[str, Dict[str, Any]]] = None
        if not tools:
            return
        self.properties = {}
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError(f"a tool must be a dict, got {type(tool).__name__}")
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"a tool needs a non-empty string name, got {name!r}")
            params = fn.get("parameters", fn.get("input_schema")) or {}
            props = params.get("properties") if isinstance(params, dict) else None
            self.properties[name] = props if isinstance(props, dict) else {}

    def check(self, name: str) -> Dict[str, Any]:
        """The properties schema of ``name``; MarkupError for an unknown tool."""
        if not isinstance(name, str) or not name:
            raise MarkupError(f"bad tool name {name!r}")
        if self.properties is None:
            return {}
        if name not in self.properties:
            raise MarkupError(f"unknown tool {name!r}")
        return self.properties[name]


ParseFn = Callable[[str, ToolIndex], List[Tuple[str, Dict[str, Any]]]]
ScanFn = Callable[[str, Markers], Optional[Tuple[str, int]]]


def scan_plain(buf: str, markers: Markers) -> Optional[Tuple[str, int]]:
    """Where the markup that ``buf`` opens with ends.

    ``("close", end)``: the markup is ``buf[:end]`` (closing marker included);
    ``("reopen", j)``: the same opening marker starts again at ``j`` before any
    close, so ``buf[:j]`` was not markup after all; ``None``: undecided yet.
    """
    open_, close = markers
    c = buf.find(close, len(open_))
    r = buf.find(open_, len(open_))
    if r != -1 and (c == -1 or r < c):
        return ("reopen", r)
    if c != -1:
        return ("close", c + len(close))
    return None


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls in decoded text.

    ``markers``: the (open, close) pairs that delimit markup; ``parse`` turns
    one complete markup (markers included) into ``[(name, arguments)]`` or
    raises MarkupError; ``scan`` finds the end of a markup (see scan_plain).
    """

    name: str
    markers: Tuple[Markers, ...]
    parse: ParseFn
    scan: ScanFn = scan_plain
    description: str = ""

    def __repr__(self) -> str:
        return f"ToolFormat({self.name!r})"


def dumps_arguments(arguments: Dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


class StreamSplitter:
    """Text fed in chunks, events out: `feed(text)` then `finish()` once. Subclasses
    keep the unconsumed text in `_buf` and implement `_drain(final)`, which
    returns the events that `_buf` allows so far (all of them when final)."""

    def __init__(self):
        self._buf = ""
        self._finished = False

    def feed(self, text: str) -> list:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list:
        if self._finished:
            return []
        out = self._drain(final=True)
        self._finished = True
        return out

    def _drain(self, final: bool) -> list:
        raise NotImplementedError
