"""OpenAI Responses: request and response models (/v1/responses)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from .common import (Body, Int, Out, SamplingFields, StringOrStrings, described, nullable,
                     sse_events)
from .openai import TOOL_SCHEMA

PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["input_text", "output_text", "text", "refusal"]},
    "text": {"type": "string"}}}
TEXT_OR_PARTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": PART}, {"type": "null"}]}
ITEM = {"anyOf": [
    {"type": "object", "required": ["role"], "properties": {
        "type": nullable({"type": "string", "enum": ["message"],
                          "description": "May be left out on a message."}),
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": TEXT_OR_PARTS}},
    {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function_call"]},
        "call_id": nullable({"type": "string"}), "id": nullable({"type": "string"}),
        "name": {"type": "string", "minLength": 1},
        "namespace": nullable({"type": "string", "description": "A namespace tool's call."}),
        "arguments": {"type": "string", "description": "A JSON string."}}},
    {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["custom_tool_call"]},
        "call_id": nullable({"type": "string"}), "id": nullable({"type": "string"}),
        "name": {"type": "string", "minLength": 1},
        "namespace": nullable({"type": "string", "description": "A namespace tool's call."}),
        "input": {"type": "string", "description": "The custom tool's free-text input."}}},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["function_call_output", "custom_tool_call_output"]},
        "call_id": nullable({"type": "string"}), "output": TEXT_OR_PARTS}},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["reasoning"]}},
     "description": "Dropped."}]}
Input = described({"anyOf": [{"type": "string"}, {"type": "array", "items": ITEM}],
                   "description": "A user message, or input items."})
FLAT_TOOL = {"type": "object", "properties": {
    "type": nullable({"type": "string",
                      "description": "\"function\", \"custom\" (free-text input, answered "
                                     "with a custom_tool_call item) or \"namespace\" (`tools`: "
                                     "function and custom tools, called with their "
                                     "`namespace`); built-in tool types are dropped"}),
    "name": {"type": "string", "minLength": 1}, "description": nullable({"type": "string"}),
    "parameters": nullable({"type": "object"}), "strict": nullable({"type": "boolean"}),
    "format": nullable({"type": "object", "description": "custom tools: {type: text} or "
                        "{type: grammar, syntax, definition} (shown to the model)"}),
    "tools": nullable({"type": "array", "description": "a namespace's tools"})}}
Tools = described({"anyOf": [{"type": "array", "items": {"anyOf": [FLAT_TOOL, TOOL_SCHEMA]}},
                             {"type": "null"}]})
ToolChoice = described({"anyOf": [
    {"type": "string", "enum": ["auto", "none", "required"]},
    {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}}},
    {"type": "null"}], "description": "A named function must be among `tools`."})
TextFormat = described({"anyOf": [
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["json_schema"]}, "name": nullable({"type": "string"}),
        "schema": {"type": "object"}, "strict": nullable({"type": "boolean"})}},
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
    metadata: Optional[dict[str, Any]] = Field(None, description="Echoed back in the response.")
    user: Optional[str] = Field(None, description="Echoed back in the response.")


# --- responses -------------------------------------------------------------------------


class OutputItem(Out):
    id: str
    type: Literal["message", "reasoning", "function_call"]
    status: str
    role: Optional[str] = None
    content: Optional[list[dict[str, Any]]] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    namespace: Optional[str] = None
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
