"""Gemma 4 native tool calls.

Grammar (as the Gemma 4 chat template renders calls, and as mlx-lm's
``tool_parsers/gemma4.py`` reads them)::

    markup  := "<|tool_call>" ws call (ws call)* ws "<tool_call|>"
    call    := "call:" NAME object            NAME = [A-Za-z0-9_.-]+
    object  := "{" [ member ("," member)* [","] ] "}"
    member  := ws key ws ":" value
    key     := bare key | string              bare key: no space : , { } [ ] < > "
    value   := ws (string | object | array | bare) ws
    string  := '<|"|>' any text, verbatim, no escapes '<|"|>'  |  a JSON "string"
    array   := "[" [ value ("," value)* [","] ] "]"
    bare    := text up to , } ] (numbers, true, false, null; other text is a string)

``<|"|>`` is Gemma 4's string-quote token: everything between two of them is
the string (braces, commas, quotes and newlines included). The markers and the
quote token are special tokens, so the detokenizer must keep special tokens
for this format to see them.

Schema decoding (top-level params only): a bare value is decoded against the
param's schema (``decode_text``; with no schema it is read as JSON where it
parses); a quoted string or a nested value goes through ``coerce_typed``.
mlx-lm only accepts ``\\w+`` keys directly after ``{`` or ``,`` (no spaces) and
fails on any bare word; this reader is a superset on well-formed calls.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

from engine.text.tools.base import MarkupError, ToolFormat, ToolIndex
from engine.text.tools.schema import coerce_typed, decode_text, json_or_raw

OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_KEY = re.compile(r'[^\s:,{}\[\]<>"]+')
_WS = re.compile(r"\s*")
_JSON = json.JSONDecoder(strict=False)
_MAX_DEPTH = 64


class _Reader:
    def __init__(self, text: str):
        self.s, self.i = text, 0

    def ws(self) -> None:
        self.i = _WS.match(self.s, self.i).end()

    def peek(self, tok: str) -> bool:
        return self.s.startswith(tok, self.i)

    def expect(self, tok: str) -> None:
        if not self.peek(tok):
            raise MarkupError(f"expected {tok!r} at {self.i}: {self.s[self.i:self.i + 20]!r}")
        self.i += len(tok)

    def string(self) -> str:
        if self.peek(QUOTE):
            end = self.s.find(QUOTE, self.i + len(QUOTE))
            if end == -1:
                raise MarkupError("unterminated <|\"|> string")
            out = self.s[self.i + len(QUOTE):end]
            self.i = end + len(QUOTE)
            return out
        try:
            out, self.i = _JSON.raw_decode(self.s, self.i)
        except ValueError as e:
            raise MarkupError(f"bad string at {self.i}") from e
        if not isinstance(out, str):
            raise MarkupError(f"expected a string at {self.i}")
        return out

    def key(self) -> str:
        self.ws()
        if self.peek(QUOTE) or self.peek('"'):
            return self.string()
        m = _KEY.match(self.s, self.i)
        if not m:
            raise MarkupError(f"expected a key at {self.i}")
        self.i = m.end()
        return m.group()

    def value(self, depth: int) -> Tuple[Any, bool]:
        """(value, is_bare); a bare value is returned as its stripped text."""
        if depth > _MAX_DEPTH:
            raise MarkupError("nested too deep")
        self.ws()
        if self.peek(QUOTE) or self.peek('"'):
            out, bare = self.string(), False
        elif self.peek("{"):
            out, bare = self.object(depth + 1, None), False
        elif self.peek("["):
            out, bare = self.array(depth + 1), False
        else:
            start = self.i
            while self.i < len(self.s) and self.s[self.i] not in ",}]" and not self.peek(QUOTE) \
                    and self.s[self.i] not in "{[":
                self.i += 1
            out, bare = self.s[start:self.i].strip(), True
            if not out:
                raise MarkupError(f"missing value at {start}")
        self.ws()
        return out, bare

    def object(self, depth: int, props) -> Dict[str, Any]:
        self.expect("{")
        out: Dict[str, Any] = {}
        self.ws()
        while not self.peek("}"):
            k = self.key()
            self.ws()
            self.expect(":")
            v, bare = self.value(depth)
            if props is not None:  # top level: decode against the param schema
                schema = props.get(k)
                v = decode_text(v, schema, untyped="json") if bare else coerce_typed(v, schema)
            elif bare:
                v = json_or_raw(v)
            out[k] = v
            if self.peek(","):
                self.i += 1
                self.ws()
            elif not self.peek("}"):
                raise MarkupError(f"expected , or }} at {self.i}")
        self.i += 1
        return out

    def array(self, depth: int) -> List[Any]:
        self.expect("[")
        out: List[Any] = []
        self.ws()
        while not self.peek("]"):
            v, bare = self.value(depth)
            out.append(json_or_raw(v) if bare else v)
            if self.peek(","):
                self.i += 1
                self.ws()
            elif not self.peek("]"):
                raise MarkupError(f"expected , or ] at {self.i}")
        self.i += 1
        return out


def parse(markup: str, index: ToolIndex) -> List[Tuple[str, Dict[str, Any]]]:
    if not (markup.startswith(OPEN) and markup.endswith(CLOSE)):
        raise MarkupError("not a Gemma 4 tool call")
    r = _Reader(markup[len(OPEN):len(markup) - len(CLOSE)])
    calls = []
    r.ws()
    while r.i < len(r.s):
        r.expect("call:")
        m = _NAME.match(r.s, r.i)
        if not m:
            raise MarkupError("missing function name")
        r.i = m.end()
        props = index.check(m.group())
        r.ws()
        calls.append((m.group(), r.object(0, props)))
        r.ws()
    if not calls:
        raise MarkupError("empty tool call")
    return calls


FORMAT = ToolFormat(
    name="gemma4",
    markers=((OPEN, CLOSE),),
    parse=parse,
    description="Gemma 4: <|tool_call>call:name{key:<|\"|>text<|\"|>,n:1}<tool_call|>",
)
