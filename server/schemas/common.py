"""Building blocks of the request and response models (pydantic v2).

Request models are validated by FastAPI before a handler runs (after the ASGI
guards in `server.limits` / `server.security`, which see the raw bytes first).
They are strict: a string is never a number, a boolean never an integer, NaN
and infinities are refused; an integral float (`2.0`) is an integer. Unknown
fields are allowed (the OpenAI and Anthropic APIs tolerate them; clients send
vendor extras).

What the models check: the type of every field the handlers read, numeric
ranges, enumerations and required fields. What the handlers still check (also a
400 naming the field): rules across fields (a `tool_choice` naming a tool that
is among `tools`), a JSON schema the grammar engine accepts, the content of
message parts and input items (their messages name the item: `messages[2]`).
Fields whose values take several shapes (a string or a list of parts) are
`Flexible`: their JSON schema is written out in full for the document, their
check is a plain function that keeps the handler's wording.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator,
                      WithJsonSchema)
from pydantic_core import PydanticCustomError

from engine import RANGES, SEED_MAX  # the engine's own ranges: one source

_TEMP, _PRESENCE, _FREQUENCY = (RANGES[k] for k in ("temperature", "presence_penalty",
                                                     "frequency_penalty"))


class Body(BaseModel):
    """A request body or a nested request object: strict types, extra fields kept."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Out(BaseModel):
    """A response object (documentation and conformance checks only: handlers build
    plain dicts; fields the model does not list are allowed)."""

    model_config = ConfigDict(extra="allow")


def _whole(v):
    """`2.0` is the integer 2 (as the handlers always read it); `2.5` stays a float
    and fails the strict integer check."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63:
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_whole)]


def flexible(schema: dict, check: Callable[[Any], Any]) -> Any:
    """A field of several shapes: `schema` documents it, `check(value)` validates it
    (raising `invalid(...)`) and returns it unchanged."""
    return Annotated[Any, PlainValidator(check), WithJsonSchema(schema)]


def invalid(kind: str, message: str) -> PydanticCustomError:
    """A validation error whose message follows the field's path ("<field> <message>")."""
    return PydanticCustomError(kind, message)


def _string_or_strings(v):
    if v is None or isinstance(v, str) or (isinstance(v, list)
                                           and all(isinstance(s, str) for s in v)):
        return v
    raise invalid("flexible", "must be a string or an array of strings")


STRINGS_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                            {"type": "null"}]}
StringOrStrings = flexible(STRINGS_SCHEMA, _string_or_strings)


def nullable(schema: dict) -> dict:
    """`schema` or null (a field the handler reads as absent when it is null)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _any(v):
    return v


def described(schema: dict) -> Any:
    """A field whose every value is read by the handler (which answers a 400 naming
    the field for one it cannot use): `schema` documents the accepted shapes."""
    return flexible(schema, _any)


class SamplingFields(Body):
    """The sampling fields every protocol reads (absent or null = the server's default,
    then the model's `generation_config.json`)."""

    temperature: Optional[float] = Field(None, ge=_TEMP[0], le=_TEMP[1], description=(
        "Sampling temperature; 0 is greedy."))
    top_p: Optional[float] = Field(None, ge=0, le=1, description="Nucleus sampling mass.")
    top_k: Optional[Int] = Field(None, ge=0, description="Keep the k most likely tokens (0: off).")
    min_p: Optional[float] = Field(None, ge=0, le=1, description=(
        "Drop tokens below min_p x the top token's probability."))
    repetition_penalty: Optional[float] = Field(None, ge=0, description=(
        "Divide the logits of recent tokens by this (1: off)."))
    repetition_context_size: Optional[Int] = Field(None, ge=1, description=(
        "How many recent tokens the repetition/presence/frequency penalties look at."))
    presence_penalty: Optional[float] = Field(None, ge=_PRESENCE[0], le=_PRESENCE[1], description=(
        "Subtracted once from the logit of every token already generated."))
    frequency_penalty: Optional[float] = Field(None, ge=_FREQUENCY[0], le=_FREQUENCY[1],
                                               description=(
        "Subtracted from a token's logit per occurrence so far."))
    seed: Optional[Int] = Field(None, ge=0, le=SEED_MAX, description=(
        "Seed of this request's sampling (same seed, same prompt: same tokens)."))
    spec_sampling: Optional[Literal["exact", "rejection"]] = Field(None, description=(
        "With a draft model, how sampled tokens keep drafts: \"exact\" (mlx-lm's scheme, "
        "its bits) or \"rejection\" (speculative sampling: the model's distribution, more "
        "drafts kept). Absent: the server's --spec-sampling."))
    logit_bias: Optional[dict[str, float]] = Field(None, description=(
        "Token id (as a string) to a bias added to its logit; ids must be in the vocabulary."))
    adapter: StringOrStrings = Field(None, description=(
        "Mounted LoRA adapters for this request: \"id\", \"a+b\" (stacked), \"none\" "
        "(the base model) or a list of ids. Absent: the server's default adapters."))
    adapters: StringOrStrings = Field(None, description="Alias of `adapter`.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "Extra variables for the chat template (e.g. {\"enable_thinking\": false})."))
    reasoning_effort: Optional[str] = Field(None, description=(
        "\"none\" switches a thinking model's reasoning off; any other value on."))
    model: Optional[str] = Field(None, description=(
        "The model to answer with when the server serves several (`GET /v1/models`; an "
        "unknown one is a 404, an absent one the first listed). One model served: "
        "accepted and ignored."))
    stream: Optional[bool] = Field(False, description=(
        "Stream the answer as server-sent events (text/event-stream)."))


# --- error bodies -------------------------------------------------------------------


class OpenAIErrorDetail(Out):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, request_too_large, "
                                  "authentication_error, permission_error, overloaded_error, "
                                  "memory_admission, server_error, ...")
    param: Optional[str] = Field(None, description="The request field at fault, if any.")
    code: Optional[str] = Field(None, description="e.g. context_length_exceeded, "
                                                  "context_over_budget")


class OpenAIError(Out):
    """The OpenAI error shape (chat, completions, responses, admin routes)."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(Out):
    type: str = Field(description="invalid_request_error, authentication_error, "
                                  "permission_error, not_found_error, request_too_large, "
                                  "overloaded_error, api_error")
    message: str


class AnthropicError(Out):
    """The Anthropic error shape (/v1/messages)."""

    type: str = Field("error", pattern="^error$")
    error: AnthropicErrorDetail


WHY = {400: "Invalid request: the message names the field (`param` on OpenAI routes).",
       401: "Missing or wrong API key (--api-key).",
       403: "Origin or Host not allowed (--cors-origins, --allowed-hosts).",
       404: "Not found.",
       408: "The request body did not arrive in time.",
       413: "Body or prompt over the limit (--max-body-mb, --max-prompt-chars).",
       415: "Content-Type is not application/json.",
       500: "Server fault (the log has the traceback under the reference in the message).",
       503: "At capacity (--max-queue): retry after Retry-After seconds."}
GENERATION_ERRORS = (400, 401, 403, 408, 413, 415, 500, 503)
READ_ERRORS = (401, 403, 500)


def sse_events(payload: dict, done: bool = False) -> dict:
    """The schema of one server-sent event (OpenAPI's convention for `text/event-stream`:
    `schema` describes each event, `data` holds JSON of `payload`'s shape; `done`: the
    stream ends with `data: [DONE]`, as OpenAI's)."""
    data: dict = {"type": "string", "contentMediaType": "application/json",
                  "contentSchema": payload}
    if done:
        data = {"anyOf": [{"type": "string", "enum": ["[DONE]"]}, data]}
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "data": data},
        "description": "One server-sent event (with `stream: true`)."}


def responses_for(ok: Optional[type], errors: tuple, anthropic: bool = False,
                  stream: Optional[dict] = None, ok_doc: str = "Success.") -> dict:
    """The `responses=` of a route: its 200 body (JSON, and `text/event-stream` events of
    the `stream` schema when it can stream) and its error statuses in the protocol's
    error shape."""
    out: dict = {}
    if ok is not None:
        out[200] = {"model": ok, "description": ok_doc}
        if stream is not None:
            out[200]["content"] = {"text/event-stream": {"schema": stream}}
    shape = AnthropicError if anthropic else OpenAIError
    for code in errors:
        out[code] = {"model": shape, "description": WHY[code]}
        if code == 503:
            out[code]["headers"] = {"Retry-After": {
                "description": "Seconds to wait before retrying.",
                "schema": {"type": "integer", "minimum": 0}}}
    return out
