"""Anthropic Messages: request and response models (/v1/messages, /count_tokens)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from .common import Body, Int, Out, SamplingFields, described, nullable, sse_events

TEXT_BLOCK = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
BLOCK = {"anyOf": [
    TEXT_BLOCK,
    {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["tool_use"]}, "id": nullable({"type": "string"}),
        "name": {"type": "string", "minLength": 1},
        "input": {"anyOf": [{"type": "object"}, {"type": "string", "description": "JSON"}]}},
     "description": "Assistant messages only."},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["tool_result"]},
        "tool_use_id": nullable({"type": "string"}),
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK},
                              {"type": "null"}]},
        "is_error": nullable({"type": "boolean"})},
     "description": "User messages only."},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["thinking", "redacted_thinking"]}},
     "description": "Dropped (earlier reasoning is not re-read)."}],
    "description": "Image and document blocks are refused (400): the model reads text only."}
MessageContent = described({"anyOf": [{"type": "string"}, {"type": "array", "items": BLOCK}],
                            "description": "A string or content blocks."})
System = described({"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK},
                              {"type": "null"}],
                    "description": "The system prompt: a string or text blocks."})
Tools = described({"anyOf": [{"type": "array", "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "minLength": 1,
                 "description": "Required for a custom tool."},
        "description": nullable({"type": "string"}),
        "input_schema": nullable({"type": "object"}),
        "type": nullable({"type": "string", "description": "custom (default); server tool "
                                                           "types (web_search_*, bash_*, ...) "
                                                           "are dropped"})}}},
    {"type": "null"}]})


class InputMessage(Body):
    role: Literal["user", "assistant", "system"] = Field(description=(
        "A system message may stand anywhere in the conversation: it is placed in the "
        "prompt where it occurs (text only)."))
    content: MessageContent


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"] = Field(description=(
        "any: some tool must be called; tool: the tool `name` (enforced by a grammar)."))
    name: Optional[str] = Field(None, description="With type tool: one of `tools`.")
    disable_parallel_tool_use: Optional[bool] = False


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"] = Field(description=(
        "Switches the chat template's enable_thinking; adaptive: on when the model's "
        "template reasons, else unchanged."))
    budget_tokens: Optional[Int] = Field(None, ge=1, description=(
        "Accepted; max_tokens bounds reasoning and answer together."))
    display: Optional[Literal["summarized", "omitted"]] = Field(None, description=(
        "omitted: thinking blocks come back with empty text; summarized (default): the "
        "reasoning as the model wrote it (nothing summarizes it)."))


class OutputConfig(Body):
    effort: Optional[str] = Field(None, description=(
        "Accepted and ignored (a local model has no effort levels)."))


class CountTokensRequest(SamplingFields):
    """POST /v1/messages/count_tokens."""

    messages: list[InputMessage] = Field(json_schema_extra={"minItems": 1})
    system: System = None
    max_tokens: Optional[Int] = Field(None, ge=1, description="Tokens to generate at most.")
    stop_sequences: Optional[list[str]] = Field(None, description=(
        "Stop strings; the one that stopped is `stop_sequence`."))
    tools: Tools = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    metadata: Optional[dict[str, Any]] = Field(None, description="Accepted and ignored.")
    output_config: Optional[OutputConfig] = None
    context_management: Optional[dict[str, Any]] = Field(None, description=(
        "Accepted and ignored: the server edits no context (the client sends what the "
        "prompt holds)."))


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (max_tokens is required, as in the Anthropic API)."""

    max_tokens: Int = Field(ge=1, description="Tokens to generate at most (required).")


# --- responses -------------------------------------------------------------------------


class MessageUsage(Out):
    input_tokens: int = Field(description="Prompt tokens not read from the prompt cache.")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens read from the cache.")
    cache_creation_input_tokens: int


class ContentBlock(Out):
    type: Literal["text", "thinking", "tool_use"]
    text: Optional[str] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None


class Message(Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: Optional[str]
    usage: MessageUsage


class TokenCount(Out):
    input_tokens: int


EVENTS = sse_events({"type": "object", "required": ["type"], "properties": {"type": {
    "type": "string", "enum": ["message_start", "content_block_start", "content_block_delta",
                               "content_block_stop", "message_delta", "message_stop",
                               "error", "ping"]}}})
