"""Error shapes, one per protocol family.

OpenAI-style routes (chat, completions, responses, admin):

    {"error": {"message": ..., "type": "invalid_request_error", "param": null, "code": null}}

Over-budget context (memory admission) keeps that shape with
``type: "memory_admission"`` and ``code: "context_over_budget"``.

A prompt longer than the model's context: ``code: "context_length_exceeded"``.

Anthropic routes (``/v1/messages``):

    {"type": "error", "error": {"type": "invalid_request_error", "message": ...}}

with the Anthropic type names per status (401 ``authentication_error``, 404
``not_found_error``, 413 ``request_too_large``, 5xx ``api_error``); an
admission refusal adds ``code: "context_over_budget"``.

Client mistakes never surface as a 500 with a traceback; an unexpected server
fault is a 500 with the same shape and a one-line message (the traceback goes
to the log).
"""

from __future__ import annotations

import os
import re
from typing import Optional

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "request_too_large", 415: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error the client sees: HTTP status + message (+ OpenAI type/code/param)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type
        self.code = code
        self.param = param


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def not_found(message: str) -> APIError:
    return APIError(404, message, type="not_found_error")


def from_exception(exc: BaseException) -> APIError:
    """Map an engine exception raised by client input onto an APIError (400)."""
    from engine import ContextOverBudget
    from engine import ContextLengthExceeded

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceeded):
        return APIError(400, f"prompt is too long: {exc}. Shorten the prompt.",
                        code="context_length_exceeded")
    if isinstance(exc, ContextOverBudget):
        return APIError(400, f"{exc}. Lower max_tokens or shorten the prompt; the ceiling is "
                             f"visible at /stats.", type="memory_admission",
                        code="context_over_budget")
    return APIError(400, str(exc) or "invalid request", param=getattr(exc, "param", None))


_ABS_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.+@-]+/?)+")
_NANOBIND = re.compile(r"incompatible function arguments\..*", re.S)
_EXC_NAME = re.compile(r"\b(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception): ")


def _hide_path(m: "re.Match") -> str:
    top = m.group(0).strip("/").split("/", 1)[0]
    return "<path>" if top and os.path.isdir("/" + top) else m.group(0)


def scrub(message: str) -> str:
    """A client-facing message without internals: absolute filesystem paths become
    `<path>` (route paths such as /v1/models are kept), native binding signatures and
    exception class names are cut, and the length is bounded."""
    message = _NANOBIND.sub("invalid argument", message)
    message = _EXC_NAME.sub("", message)
    message = _ABS_PATH.sub(_hide_path, message)
    return message if len(message) <= 2000 else message[:2000] + "..."


def openai_body(err: APIError) -> dict:
    if err.status >= 500 and err.type == "invalid_request_error":
        err.type = "server_error"
    return {"error": {"message": scrub(err.message), "type": err.type, "param": err.param,
                      "code": err.code}}


def anthropic_body(err: APIError) -> dict:
    if err.status >= 500:
        t = ANTHROPIC_TYPES.get(err.status, "api_error")
    else:
        t = ANTHROPIC_TYPES.get(err.status, "invalid_request_error")
    body = {"type": t, "message": scrub(err.message)}
    if err.code:
        body["code"] = err.code
    return {"type": "error", "error": body}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def body_for(path: str, err: APIError) -> dict:
    return anthropic_body(err) if is_anthropic_path(path) else openai_body(err)


# --- request validation errors (pydantic, via FastAPI) -------------------------------

_TYPE_WORDS = {"int_type": "an integer", "int_from_float": "an integer",
               "int_parsing": "an integer", "float_type": "a number",
               "float_parsing": "a number", "finite_number": "a number",
               "bool_type": "a boolean", "string_type": "a string", "dict_type": "an object",
               "model_type": "an object", "model_attributes_type": "an object",
               "list_type": "an array"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"),
           "greater_than": (">", "gt"), "less_than": ("<", "lt")}


def _where(path) -> tuple:
    """('messages', 0, 'role') -> ("messages[0].role", "messages"): the field's full path
    for the message, and `param` (its named fields up to the first array index, as
    the handlers name them: messages, tools, response_format.type)."""
    where, param, indexed = "", [], False
    for p in path:
        if isinstance(p, int):
            where += f"[{p}]"
            indexed = True
        else:
            where += ("." if where else "") + str(p)
            if not indexed:
                param.append(str(p))
    return where, ".".join(param) or None


def _shown(v) -> str:
    import json
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def from_validation(errors: list) -> APIError:
    """The first error of a FastAPI `RequestValidationError` as a 400 naming the field."""
    e = errors[0]
    loc = tuple(e.get("loc") or ())
    path = loc[1:] if loc[:1] == ("body",) else loc
    kind, ctx, value = e.get("type", ""), e.get("ctx") or {}, e.get("input")
    if kind == "json_invalid":
        at = f" (char {loc[1]})" if len(loc) > 1 and isinstance(loc[1], int) else ""
        return bad_request(f"invalid JSON body: {ctx.get('error', 'not JSON')}{at}")
    if not path or all(isinstance(p, int) for p in path):      # the body itself
        if kind == "missing":
            return bad_request("invalid JSON body: the body is empty")
        return bad_request(f"invalid JSON body: expected an object, got {type(value).__name__}")
    where, param = _where(path)
    if kind == "missing":
        msg = f"{where} required"
    elif kind in _TYPE_WORDS:
        msg = f"{where} must be {_TYPE_WORDS[kind]}, got {_shown(value)}"
    elif kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        msg = f"{where} must be {op} {ctx.get(key)}, got {_shown(value)}"
    elif kind == "literal_error":
        msg = f"{where} must be one of {ctx.get('expected')}, got {_shown(value)}"
    elif kind == "too_short" and ctx.get("min_length") == 1:
        msg = f"{where} required: the array is empty"
    elif kind in ("too_short", "too_long", "string_too_short", "string_too_long"):
        msg = f"{where}: {e.get('msg', 'wrong length')}"
    elif kind.startswith("string_") or kind.startswith("dict_") or kind.endswith("_type"):
        msg = f"{where}: {e.get('msg', 'invalid value')}"
    else:                 # the schemas' own checks (server.schemas.common.invalid)
        msg = f"{where} {e.get('msg', 'is invalid')}"
    return bad_request(msg, param=param)
