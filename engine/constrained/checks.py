"""Schemas a grammar cannot honour, refused before anything is compiled.

``check_schema(schema, special_texts, max_nodes=..., max_count=...)`` raises
``ValueError`` naming the problem for a JSON schema whose constrained output
could never be finished or could not be written by the model:

- larger than ``max_nodes`` JSON nodes (objects, arrays and scalars of the
  schema counted together; the compile time grows with it);
- not a JSON Schema (checked against the Draft 7 meta-schema with the
  ``jsonschema`` package: the keyword shapes every draft shares; later
  drafts' keywords are accepted);
- a string the output would have to contain (a ``const`` / ``enum`` value, a
  property name) that holds the text of one of the tokenizer's special tokens
  (``<|im_end|>``): the model writes that text only as the special token, which
  is not the text, so the grammar would dead-end there;
- a lower bound (``minItems``, ``minProperties``, ``minLength``, or the
  shortest match of a ``pattern``) above ``max_count``: no output that long fits.

``check_tool_names(names)`` checks tool names against OpenAI's rule
(``^[a-zA-Z0-9_-]{1,64}$``) and refuses duplicates.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

__all__ = ["check_schema", "check_json_schema", "check_tool_names", "schema_nodes", "TOOL_NAME",
           "DEFAULT_MAX_SCHEMA_NODES"]

DEFAULT_MAX_SCHEMA_NODES = 10_000
DEFAULT_MAX_COUNT = 100_000
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_MIN_KEYS = ("minItems", "minProperties", "minLength", "minContains")


def schema_nodes(value, stop: Optional[int] = None) -> int:
    """JSON nodes in ``value`` (stops counting once past ``stop``)."""
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        n += 1
        if stop is not None and n > stop:
            return n
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def check_json_schema(schema, where: str = "schema") -> None:
    """ValueError naming ``where`` when ``schema`` is not a JSON Schema (``_meta_check``)."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where} must be a JSON Schema object")
    try:
        _meta_check(schema)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


_META_OK: "OrderedDict[str, None]" = OrderedDict()   # schemas (as JSON) that passed
_META_OK_MAX = 1024
_META_KEY_MAX = 1 << 20       # larger schemas are checked every time, not remembered
_META_LOCK = threading.Lock()


def _meta_check(schema: dict) -> None:
    # jsonschema (a runtime dependency) with the Draft 7 meta-schema: it checks what
    # every draft shares (keyword types and shapes) and accepts later drafts' keywords;
    # the 2020-12 meta-schema costs about 5x as much (its dynamic references).
    # A schema that passed is remembered by its JSON text: an agent sends the same tools
    # every turn (12 small tools: ~2.7 ms of checks a request on the 2-core CPU, the
    # json.dumps that finds them again ~0.1 ms).
    import jsonschema

    try:
        key = json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError):       # (not JSON text: checked, never remembered)
        key = None
    if key is not None and len(key) > _META_KEY_MAX:
        key = None
    if key is not None:
        with _META_LOCK:
            if key in _META_OK:
                _META_OK.move_to_end(key)
                return
    try:
        jsonschema.Draft7Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"not a valid JSON Schema at {where}: {e.message}") from None
    if key is not None:
        with _META_LOCK:
            _META_OK[key] = None
            while len(_META_OK) > _META_OK_MAX:
                _META_OK.popitem(last=False)


def _pattern_min_width(pattern: str) -> int:
    """The shortest text ``pattern`` matches (0 when Python cannot tell)."""
    try:
        import re._parser as sre     # (the stdlib's own regex parser: the match width)
    except ImportError:              # pragma: no cover - other Python versions
        return 0
    try:
        return int(sre.parse(pattern).getwidth()[0])
    except Exception:                # (a syntax Python does not share: llguidance decides)
        return 0


def _walk(schema) -> Iterable[tuple]:
    """(kind, value) of every string the output must spell and every lower bound."""
    stack = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        for key, v in s.items():
            if key in ("const", "enum"):
                yield "value", v
            elif key in _MIN_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
                yield key, v
            elif key == "pattern" and isinstance(v, str):
                yield "pattern", v
            elif key in ("properties", "patternProperties", "$defs", "definitions",
                         "dependentSchemas"):
                if isinstance(v, dict):
                    if key == "properties":
                        yield "value", list(v)
                    stack.extend(v.values())
            elif isinstance(v, (dict, list)) and key not in ("default", "examples"):
                stack.append(v)


def _strings(value) -> Iterable[str]:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def check_schema(schema, special_texts: Sequence[str] = (), *, where: str = "schema",
                 max_nodes: int = DEFAULT_MAX_SCHEMA_NODES,
                 max_count: int = DEFAULT_MAX_COUNT) -> None:
    """ValueError (naming ``where`` and the limit) for a schema no grammar can honour."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object")
    n = schema_nodes(schema, stop=max_nodes)
    if n > max_nodes:
        raise ValueError(f"{where} has more than {max_nodes} JSON nodes, the limit "
                         f"(--max-schema-nodes)")
    _meta_check(schema)
    specials = [t for t in special_texts if t]
    for kind, v in _walk(schema):
        if kind == "value":
            for text in _strings(v):
                hit = next((t for t in specials if t in text), None)
                if hit is not None:
                    raise ValueError(f"{where}: the value {text[:80]!r} contains the special "
                                     f"token text {hit!r}, which the model cannot write as text")
        elif kind == "pattern":
            width = _pattern_min_width(v)
            if width > max_count:
                raise ValueError(f"{where}: the pattern {v[:80]!r} matches no text shorter "
                                 f"than {width} characters; the limit is {max_count}")
        elif v > max_count:
            raise ValueError(f"{where}: {kind} {v:g} is above {max_count}, more than any "
                             f"output can hold")


def check_tool_names(names: Sequence[str], where: str = "tools",
                     labels: Optional[Sequence[str]] = None) -> None:
    """ValueError for a tool name outside ``^[a-zA-Z0-9_-]{1,64}$`` or a repeated one (named
    by `labels[i]` where given, else ``where[i]``)."""
    seen = set()
    for i, name in enumerate(names):
        at = labels[i] if labels is not None else f"{where}[{i}]"
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"{at}: the tool name {name!r} must match "
                             f"^[a-zA-Z0-9_-]{{1,64}}$")
        if name in seen:
            raise ValueError(f"{at}: the tool name {name!r} is used twice; tool "
                             f"names must be unique")
        seen.add(name)
