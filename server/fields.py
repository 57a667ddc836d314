"""Typed reads of JSON request fields with 400s that name the field.

Every reader takes the body dict and a key and returns the value or the
default when the key is absent or null; a value of the wrong type raises
`APIError(400)` naming the field (booleans are never numbers). The routes'
request models (`server.schemas`) have checked the types already; these reads
keep the protocol parsers correct on their own (tests and tools call them with
plain dicts).
"""

from __future__ import annotations

import json
import math
from numbers import Integral, Real
from typing import Any, Optional

from .errors import bad_request

_MISSING = object()


def _get(body: dict, key: str):
    v = body.get(key, _MISSING)
    return _MISSING if v is None else v


def number(body: dict, key: str, default=None, lo: Optional[float] = None,
           hi: Optional[float] = None) -> Optional[float]:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
        raise bad_request(f"{key} must be a number, got {json.dumps(v)}", param=key)
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad_request(f"{key} must be in {rng}, got {v}", param=key)
    return float(v) if not isinstance(v, Integral) else v


def integer(body: dict, key: str, default=None, lo: Optional[int] = None,
            hi: Optional[int] = None) -> Optional[int]:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise bad_request(f"{key} must be an integer, got {json.dumps(v)}", param=key)
    if lo is not None and v < lo:
        raise bad_request(f"{key} must be >= {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise bad_request(f"{key} must be <= {hi}, got {v}", param=key)
    return int(v)


def boolean(body: dict, key: str, default=None) -> Optional[bool]:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be a boolean, got {json.dumps(v)}", param=key)
    return v


def string(body: dict, key: str, default=None) -> Optional[str]:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, str):
        raise bad_request(f"{key} must be a string, got {json.dumps(v)[:80]}", param=key)
    return v


def obj(body: dict, key: str, default=None) -> Optional[dict]:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, dict):
        raise bad_request(f"{key} must be an object", param=key)
    return v


def array(body: dict, key: str, default=None) -> Optional[list]:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, list):
        raise bad_request(f"{key} must be an array", param=key)
    return v


def stop_list(body: dict, key: str) -> list:
    """A stop string or a list of them."""
    v = _get(body, key)
    if v is _MISSING:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise bad_request(f"{key} must be a string or an array of strings", param=key)


def logit_bias(body: dict, key: str, vocab_size: int) -> Optional[dict]:
    v = _get(body, key)
    if v is _MISSING or v == {}:
        return None
    if not isinstance(v, dict):
        raise bad_request(f"{key} must be a dict of int to float", param=key)
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"{key} must be a dict of int to float (bad key {k!r})",
                              param=key) from None
        if not 0 <= tid < vocab_size:
            raise bad_request(f"{key}: token id {tid} is outside the vocabulary "
                              f"(size {vocab_size})", param=key)
        if isinstance(b, bool) or not isinstance(b, Real) or not math.isfinite(b):
            raise bad_request(f"{key} must be a dict of int to float (bad value for {k})",
                              param=key)
        out[tid] = float(b)
    return out


def text_content(content: Any, where: str, text_types=("text", "input_text", "output_text")) -> str:
    """A message `content` (string, null or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
                continue
            if not isinstance(p, dict):
                raise bad_request(f"{where}: content parts must be objects")
            t = p.get("type")
            if t in text_types:
                text = p.get("text")
                if not isinstance(text, str):
                    raise bad_request(f"{where}: a {t} part needs a string 'text'")
                parts.append(text)
            elif t in ("image_url", "image", "input_image", "input_audio", "file", "input_file"):
                raise bad_request(f"{where}: {t} content is not supported: this model has no "
                                  "vision/audio sidecar")
            else:
                raise bad_request(f"{where}: unknown content part type {t!r}")
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or an array of parts")
