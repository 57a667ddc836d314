"""Decode tool-call argument values against the tool's JSON schema.

Two entry points:

- ``decode_text(raw, schema)`` for formats whose values are untyped text
  (MiniCPM XML, Qwen equals-XML, Gemma 4 bare scalars). A param whose schema
  only allows strings keeps its text verbatim, even ``"007"``, ``"true"`` or
  ``"{...}"``; otherwise the text is parsed as the first schema type it fits,
  in the order integer, number, boolean, object, array, string.
- ``coerce_typed(value, schema)`` for values that are already typed (JSON
  arguments, Gemma 4 ``<|"|>`` strings and nested objects): a string-only param
  given a number/bool/object gets its JSON text; a non-string param given a
  string is decoded with ``decode_text``.

Only top-level params are checked against their schema; nested values stay as
the model wrote them.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, FrozenSet, Optional

_ALIASES = {
    "int": "integer", "long": "integer", "float": "number", "double": "number",
    "bool": "boolean", "str": "string", "text": "string", "dict": "object",
    "list": "array", "none": "null",
}
_KNOWN = {"string", "integer", "number", "boolean", "object", "array", "null"}
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?\Z")
_MISSING = object()
_LITERAL_LIMIT = 100_000


def schema_types(schema: Any) -> Optional[FrozenSet[str]]:
    """The JSON types ``schema`` allows, or None when it says nothing about types.

    Reads ``type`` (string or list), ``enum``/``const`` values and the branches
    of ``anyOf``/``oneOf``/``allOf``."""
    if not isinstance(schema, dict):
        return None
    found = set()
    t = schema.get("type")
    for name in ([t] if isinstance(t, str) else t if isinstance(t, list) else []):
        if isinstance(name, str):
            name = _ALIASES.get(name.lower(), name.lower())
            if name in _KNOWN:
                found.add(name)
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        values.append(schema["const"])
    for v in values:
        found.add(_type_of(v))
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or []:
            sub = schema_types(branch)
            if sub:
                found |= sub
    return frozenset(found) or None


def _type_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def string_only(types: Optional[FrozenSet[str]]) -> bool:
    return bool(types) and types - {"null"} == {"string"}


def json_or_raw(text: str) -> Any:
    """JSON value of ``text`` if it is one, else ``text`` itself."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _as_integer(s: str) -> Any:
    m = _NUMBER.match(s)
    if not m:
        return _MISSING
    if not m.group(1) and not m.group(2):
        return int(s)
    f = float(s)
    return int(f) if f.is_integer() and abs(f) < 2 ** 63 else _MISSING


def _as_number(s: str) -> Any:
    m = _NUMBER.match(s)
    if not m:
        return _MISSING
    return int(s) if not m.group(1) and not m.group(2) else float(s)


def _as_boolean(s: str) -> Any:
    low = s.lower()
    return True if low == "true" else False if low == "false" else _MISSING


def _as_container(s: str, kind: type) -> Any:
    try:
        v = json.loads(s, strict=False)
    except (ValueError, RecursionError):
        v = _MISSING
        if len(s) <= _LITERAL_LIMIT:  # Python-literal dicts/lists ({'a': True})
            try:
                v = ast.literal_eval(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
    return v if isinstance(v, kind) else _MISSING


_PARSERS = (
    ("integer", _as_integer),
    ("number", _as_number),
    ("boolean", _as_boolean),
    ("object", lambda s: _as_container(s, dict)),
    ("array", lambda s: _as_container(s, list)),
)


def decode_text(raw: str, schema: Any, untyped: str = "string") -> Any:
    """Value of the text ``raw`` for a param with JSON schema ``schema``.

    ``untyped`` says what to do when the schema gives no types: ``"string"``
    keeps the text (XML formats, param not in the schema), ``"json"`` parses a
    JSON value if there is one (Gemma 4 bare scalars)."""
    types = schema_types(schema)
    s = raw.strip()
    if types is None:
        if untyped == "json":
            return json_or_raw(s)
        if isinstance(schema, dict):  # a schema without types: containers only
            v = json_or_raw(s)
            return v if isinstance(v, (dict, list)) else raw
        return raw
    if "null" in types and s == "null":
        return None
    if string_only(types):
        return raw
    for name, parse in _PARSERS:
        if name in types:
            v = parse(s)
            if v is not _MISSING:
                return v
    if "string" in types:
        return raw
    try:  # nothing fits: keep any JSON value, else the text
        return json.loads(s)
    except (ValueError, RecursionError):
        return raw


def coerce_typed(value: Any, schema: Any) -> Any:
    """An already-typed ``value`` made to fit the param's schema where it plainly can."""
    types = schema_types(schema)
    if types is None:
        return value
    if isinstance(value, str):
        return value if "string" in types else decode_text(value, schema)
    if string_only(types) and not (value is None and "null" in types):
        return json.dumps(value, ensure_ascii=False)
    return value
