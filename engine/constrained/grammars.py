"""Grammars (llguidance's Lark dialect) for structured outputs and forced tool calls.

- ``json_grammar(schema)``: one JSON value valid against ``schema``
  (``{"type": "object"}`` for ``json_object``), written the way ``json.dumps``
  writes it (``", "`` and ``": "`` separators, no other whitespace), so a
  model cannot spend its tokens on whitespace.
- ``tool_call_grammar(format, tools, choice)``: one call (or several) in the
  family's own call format, to one of ``tools`` (``required``) or to the named
  one, whose arguments, as the family's parser reads them back, are valid
  against the tool's ``parameters`` schema:

  ``json_tools``   ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``
  ``gemma4``       ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>``
  ``minicpm5``     ``<function name="NAME"><param name="key">text</param></function>``
  ``qwen3_coder``  ``<tool_call>\\n<function=NAME>\\n<parameter=key>\\ntext\\n</parameter>\\n…``

  In the XML-like formats (and Gemma 4's top level) a string parameter is
  written as text (its ``enum`` as alternatives, its ``pattern`` as the
  regex, its length limits kept); any other parameter is written as JSON
  constrained by its schema. Required parameters always appear, optional
  ones may; both in the schema's order.
- ``reasoning_prefix``: an optional reasoning block before the constrained
  part (the thinking families), with an optional token budget.

Markers that are single tokens of the tokenizer are matched as those tokens
(``<[id]>``), never spelled out of smaller pieces.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from engine.text.tools.schema import schema_types, string_only

__all__ = ["json_grammar", "tool_call_grammar", "reasoning_prefix", "Literals"]

COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _quote(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Literals:
    """Lark literals for text, with the tokenizer's added tokens as ``<[id]>``."""

    def __init__(self, added_tokens: Dict[int, str]):
        self._by_text = {t: i for i, t in added_tokens.items() if t}
        self._pattern = (re.compile("|".join(re.escape(t) for t in
                                             sorted(self._by_text, key=len, reverse=True)))
                         if self._by_text else None)

    def __call__(self, text: str) -> str:
        parts, i = [], 0
        for m in (self._pattern.finditer(text) if self._pattern else ()):
            if m.start() > i:
                parts.append(_quote(text[i:m.start()]))
            parts.append(f"<[{self._by_text[m.group()]}]>")
            i = m.end()
        if i < len(text):
            parts.append(_quote(text[i:]))
        return " ".join(parts) if parts else '""'


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def close_objects(schema):
    """A copy of ``schema`` where every object schema that declares
    ``properties`` and says nothing about ``additionalProperties`` gets
    ``additionalProperties: false`` (OpenAI's strict mode; a subset of what
    the original allows, so the output still validates against it)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = close_objects(out[key])
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json(schema) -> str:
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema["x-guidance"] = {**COMPACT, **schema.get("x-guidance", {})}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _head(prefix: str, required: bool) -> str:
    return "" if not prefix else ("think " if required else "think? ")


def json_grammar(schema: Optional[dict], prefix: str = "", prefix_required: bool = False,
                 strict: bool = True) -> str:
    """Lark for one JSON value matching ``schema`` (None: any JSON object),
    after the reasoning block ``prefix`` (see ``reasoning_prefix``);
    ``strict``: objects carry only their declared properties (``close_objects``)."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    if strict:
        schema = close_objects(schema)
    return f"start: {_head(prefix, prefix_required)}body\nbody: {_json(schema)}\n{prefix}"


def reasoning_prefix(start: Optional[str], end: str, lit: Literals,
                     budget: Optional[int] = None) -> str:
    """Rules ``think`` (and ``think_body``) for an optional reasoning block:
    ``start`` (None when the prompt already opened the block) ... ``end``,
    then at most 8 whitespace characters; ``budget`` caps the reasoning tokens."""
    cap = f"[max_tokens={int(budget)}]" if budget is not None else ""
    opener = f"{lit(start)} " if start else ""
    return (f"think: {opener}think_body {lit(end)} /[ \\t\\r\\n]{{0,8}}/\n"
            f"think_body{cap}: /(?s:.*)/\n")


# ------------------------------------------------------------------ tool calls

def _tool_schemas(tools: Sequence[dict]) -> Dict[str, dict]:
    out = {}
    for t in tools:
        if not isinstance(t, dict):
            raise ValueError(f"a tool must be an object, got {type(t).__name__}")
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool needs a non-empty string name, got {name!r}")
        params = fn.get("parameters", fn.get("input_schema")) or {"type": "object"}
        if not isinstance(params, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
        out[name] = close_objects(params)   # arguments use the declared parameters only
    return out


def _strip_anchors(pattern: str) -> str:
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    return pattern


def _length(schema: dict):
    lo = max(int(schema.get("minLength", 0)), 0)
    hi = schema.get("maxLength")
    return lo, (int(hi) if hi is not None else None)


@dataclass(frozen=True)
class _TextStyle:
    """How a format writes a string parameter as text.

    ``char``: one character of a length-limited value; ``unit``/``tail``: a
    value with no length limit is ``unit* tail`` (a unit may be an escape, or
    a ``<`` that cannot start the closing markup); ``trimmed``: the parser
    strips whitespace around values, so none is written at either end
    (``edge``: a unit that is not whitespace); ``escape``: an exact value
    (enum / const) as text."""

    char: str
    unit: str
    tail: str = ""
    trimmed: bool = False
    edge: str = ""
    escape: Callable[[str], str] = str


def _text_value(schema: dict, style: _TextStyle) -> str:
    """A Lark expression for a string parameter written as text: its enum /
    const as alternatives, else its pattern, else text within its length limits."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        alts = [_quote(style.escape(v)) for v in values if isinstance(v, str)]
        if not alts:
            raise ValueError("a string enum needs string values")
        return "(" + " | ".join(alts) + ")"
    if isinstance(schema.get("pattern"), str):
        pat = _strip_anchors(schema["pattern"]).replace("/", "\\/")
        return f"/{pat}/"
    lo, hi = _length(schema)
    if lo == 0 and hi is None:     # unlimited: escapes and harmless '<' allowed
        if style.trimmed:
            return f"/({style.edge}({style.unit}*{style.edge})?)?/"
        return f"/{style.unit}*{style.tail}/"
    char = style.char
    if not style.trimmed:
        rep = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo},}}"
        return f"/{char}{rep}/"
    # no whitespace at either end: an edge character, a middle, an edge character
    edge = char[:-1] + "\\s]"
    if hi == 0:
        return '""'
    if hi == 1:
        return f"/({edge})?/" if lo == 0 else f"/{edge}/"
    mid_hi = "" if hi is None else str(hi - 2)
    longer = f"{edge}{char}{{{max(lo - 2, 0)},{mid_hi}}}{edge}"
    if lo <= 1:
        longer = f"({edge}|{longer})"
    return f"/({longer})?/" if lo == 0 else f"/{longer}/"


def _is_text(schema) -> bool:
    return isinstance(schema, dict) and string_only(schema_types(schema))


def _xml_escape(s: str) -> str:
    """MiniCPM5 text for an exact string: CDATA keeps surrounding whitespace
    (plain text is trimmed by the parser), else entities for < & >."""
    if s != s.strip() and "]]>" not in s:
        return "<![CDATA[" + s + "]]>"
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_ENTITY = "&(lt|gt|amp|quot|apos);"
# Gemma 4: verbatim between <|"|> tokens; text must not spell '<|' (a quote look-alike)
GEMMA4_TEXT = _TextStyle(char="[^<]", unit="([^<]|<+[^<|])", tail="<*")
# Qwen equals-XML: verbatim; text must not spell '</' (a closing tag look-alike)
QWEN3_CODER_TEXT = _TextStyle(char="[^<]", unit="([^<]|<+[^<\\/])", tail="<*")
# MiniCPM5: XML character data, trimmed by the parser; < and & only as entities
MINICPM5_TEXT = _TextStyle(char="[^<&]", unit=f"([^<&]|{_ENTITY})", trimmed=True,
                           edge=f"([^<&\\s]|{_ENTITY})", escape=_xml_escape)


def _members(items: List[str], required: List[bool], sep: str) -> str:
    """A Lark expression for ``items`` in order, separated by ``sep``, where the
    optional ones may be left out (an empty expression is ``""``)."""
    n = len(items)

    def rest(i: int) -> str:  # what may follow once one item is written
        if i == n:
            return ""
        head = f"{sep} {items[i]}" if sep else items[i]
        return f"{head if required[i] else f'({head})?'} {rest(i + 1)}".strip()

    def first(i: int) -> str:  # the first item written is item i or a later one
        if i == n:
            return ""
        this = f"{items[i]} {rest(i + 1)}".strip()
        if required[i]:
            return this
        later = first(i + 1)
        return f"(({this}) | ({later}))" if later else f"({this})?"

    return first(0)


def _props(schema: dict):
    props = schema.get("properties") or {}
    if not isinstance(props, dict):
        raise ValueError("tool parameters: properties must be an object")
    req = schema.get("required") or []
    return [(k, v if isinstance(v, dict) else {}, k in req) for k, v in props.items()]


def _call_json_tools(name, schema, lit, rules, r):
    body = {"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"], "additionalProperties": False}
    return f'{lit("<tool_call>")} "\\n" {_json(body)} "\\n" {lit("</tool_call>")}'


def _call_gemma4(name, schema, lit, rules, r):
    q = lit('<|"|>')
    items, req = [], []
    for i, (key, sub, required) in enumerate(_props(schema)):
        key_txt = key if re.fullmatch(r'[^\s:,{}\[\]<>"]+', key) else _quote(key)
        if _is_text(sub):
            value = f"{q} {_text_value(sub, GEMMA4_TEXT)} {q}"
        else:
            value = _json(sub)
        rules.append(f"{r}_m{i}: {_quote(key_txt + ':')} {value}")
        items.append(f"{r}_m{i}")
        req.append(required)
    members = _members(items, req, '","')
    return f'{lit("<|tool_call>")} {_quote("call:" + name + "{")} {members} "}}" ' \
           f'{lit("<tool_call|>")}'


def _call_minicpm5(name, schema, lit, rules, r):
    items, req = [], []
    for i, (key, sub, required) in enumerate(_props(schema)):
        value = _text_value(sub, MINICPM5_TEXT) if _is_text(sub) else _json(sub)
        opener = lit('<param name="' + key + '">')
        rules.append(f'{r}_p{i}: {opener} {value} '
                     f'{lit("</param>")}')
        items.append(f"{r}_p{i}")
        req.append(required)
    members = _members(items, req, "")
    opener = lit('<function name="' + name + '">')
    return f'{opener} {members} {lit("</function>")}'


def _call_qwen3_coder(name, schema, lit, rules, r):
    items, req = [], []
    close = f'"\\n" {lit("</parameter>")} "\\n"'
    for i, (key, sub, required) in enumerate(_props(schema)):
        value = _text_value(sub, QWEN3_CODER_TEXT) if _is_text(sub) else _json(sub)
        if value.startswith("/") and close == '"\\n" "</parameter>" "\\n"':
            # The lexer extends a text value while it can, so a value that may
            # hold "\n<" would swallow the start of the closing tag: the value
            # and its closing tag are one regex instead.
            body, tail = value[1:-1], "\\n<\\/parameter>\\n"
            rules.append(f'{r}_p{i}: {lit(f"<parameter={key}>")} "\\n" /({body}){tail}/')
        else:
            rules.append(f'{r}_p{i}: {lit(f"<parameter={key}>")} "\\n" {value} {close}')
        items.append(f"{r}_p{i}")
        req.append(required)
    members = _members(items, req, "")
    return (f'{lit("<tool_call>")} "\\n" {lit(f"<function={name}>")} "\\n" {members} '
            f'{lit("</function>")} "\\n" {lit("</tool_call>")}')


_CALLS = {"json_tools": _call_json_tools, "gemma4": _call_gemma4,
          "minicpm5": _call_minicpm5, "qwen3_coder": _call_qwen3_coder}
_SEPARATOR = {"json_tools": '"\\n"', "gemma4": '""', "minicpm5": '""', "qwen3_coder": '"\\n"'}


def tool_call_grammar(format_name: str, tools: Sequence[dict], name: Optional[str], lit: Literals,
                      *, parallel: bool = True, prefix: str = "",
                      prefix_required: bool = False) -> str:
    """Lark for forced tool calls in ``format_name``: to ``name`` if given
    (``tool_choice`` naming a function), else to any of ``tools``
    (``required``); several calls when ``parallel``."""
    if format_name not in _CALLS:
        raise ValueError(f"no forced-call grammar for tool format {format_name!r}; "
                         f"have {sorted(_CALLS)}")
    schemas = _tool_schemas(tools)
    if not schemas:
        raise ValueError("forcing a tool call needs at least one tool")
    if name is not None and name not in schemas:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools "
                         f"({', '.join(schemas)})")
    chosen = [name] if name is not None else list(schemas)
    rules: List[str] = []
    alts = []
    for k, fn in enumerate(chosen):
        rule = f"call{k}"
        rules.append(f"{rule}: {_CALLS[format_name](fn, schemas[fn], lit, rules, rule)}")
        alts.append(rule)
    rules.append("call: " + " | ".join(alts))
    many = f"({_SEPARATOR[format_name]} call)*" if parallel else ""
    return f"start: {_head(prefix, prefix_required)}call {many}\n" + "\n".join(rules) + "\n" + prefix
