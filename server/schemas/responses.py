"""OpenAI Responses: request and response models (/v1/responses)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from .common import Body, Int, Out, SamplingFields, StringOrStrings, described, sse_events
from .openai import TOOL_SCHEMA

PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["input_text", "output_text", "text", "refusal"]},
    "text": {"type": "string"}}}
ITEM = {"type": "object", "properties": {
    "type": {"type": "string", "enum": ["message", "function_call", "function_call_output",
                                        "reasoning"]},
    "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": PART}]},
    "call_id": {"type": "string"}, "name": {"type": "string"},
    "arguments": {"type": "string", "description": "A JSON string."},
    "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": PART}]}},
    "description": "message (role + content); function_call (call_id, name, arguments); "
                   "function_call_output (call_id, output); reasoning items are dropped."}
Input = described({"anyOf": [{"type": "string"}, {"type": "array", "items": ITEM}],
                   "description": "A user message, or input items."})
FLAT_TOOL = {"type": "object", "properties": {
    "type": {"type": "string", "description": "\"function\" (built-in tool types are dropped)"},
    "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
    "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
Tools = described({"anyOf": [{"type": "array", "items": {"anyOf": [FLAT_TOOL, TOOL_SCHEMA]}},
                             {"type": "null"}]})
ToolChoice = described({"anyOf": [
    {"type": "string", "enum": ["auto", "none", "required"]},
    {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}}},
    {"type": "null"}], "description": "A named function must be among `tools`."})
TextFormat = described({"anyOf": [{"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
    "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}},
    {"type": "null"}], "description": "Structured output, enforced by a grammar."})


class TextOptions(Body):
    format: TextFormat = None


class ReasoningOptions(Body):
    effort: Optional[str] = Field(None, description=(
        "\"none\" switches a thinking model's reasoning off; any other value on."))


class ResponsesRequest(SamplingFields):
    """POST /v1/responses."""

    input: Input
    instructions: Optional[str] = Field(None, description=(
        "A system prompt (carried forward from previous_response_id when omitted)."))
    previous_response_id: Optional[str] = Field(None, description=(
        "Continue a stored response: its input and output go before this input."))
    max_output_tokens: Optional[Int] = Field(None, ge=1, description="Tokens to generate at most.")
    stop: StringOrStrings = Field(None, description="Stop strings.")
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Optional[bool] = True
    text: Optional[TextOptions] = None
    reasoning: Optional[ReasoningOptions] = None
    store: Optional[bool] = Field(True, description=(
        "Keep the turn (1 h, byte-capped) for previous_response_id and GET."))
    metadata: Optional[dict[str, Any]] = Field(None, description="Accepted and ignored.")


# --- responses -------------------------------------------------------------------------


class OutputItem(Out):
    id: str
    type: Literal["message", "reasoning", "function_call"]
    status: str
    role: Optional[str] = None
    content: Optional[list[dict[str, Any]]] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None


class ResponseUsage(Out):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: Optional[dict[str, int]] = None
    output_tokens_details: Optional[dict[str, int]] = None


class ResponseObject(Out):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem]
    usage: Optional[ResponseUsage]
    output_text: Optional[str] = Field(None, description="All output_text parts, joined.")


class ResponseDeleted(Out):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


EVENTS = sse_events({"type": "object", "required": ["type", "sequence_number"], "properties": {
    "type": {"type": "string", "pattern": "^(response\\.|error$)"},
    "sequence_number": {"type": "integer", "minimum": 0}}})
