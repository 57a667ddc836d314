"""OpenAI chat completions and completions: request and response models."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from .common import (Body, Int, Out, SamplingFields, StringOrStrings, described, nullable,
                     sse_events)

TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text", "input_text", "output_text"]},
    "text": {"type": "string"}}}
CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART},
                            {"type": "null"}],
                  "description": "A string, or text parts (joined). Image, audio and file "
                                 "parts are refused (400): the model reads text only."}
Content = described(CONTENT_SCHEMA)


class FunctionCall(Body):
    name: str = Field(description="The function called.")
    arguments: Any = Field(None, description="Its arguments: a JSON string or an object.")


class ToolCall(Body):
    id: Optional[str] = None
    type: Optional[str] = Field("function", description=(
        "\"function\", or \"custom\" with `custom: {name, input}` (a custom tool's call)."))
    function: Optional[FunctionCall] = Field(None, description=(
        "The call (a flat {name, arguments} at this level is read too)."))


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description=(
        "\"developer\" is read as \"system\"."))
    content: Content = Field(None, description=(
        "Required, except on an assistant message that has tool_calls."))
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="Assistant messages only.")
    tool_call_id: Optional[str] = Field(None, description="Tool messages: the call answered.")
    reasoning_content: Optional[str] = Field(None, description=(
        "Assistant messages: earlier reasoning, for templates that render it."))


class FunctionDef(Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description=(
        "A JSON Schema object (default: an object with no properties)."))


TOOL_SCHEMA = {"type": "object", "properties": {
    "type": nullable({"type": "string", "description": "\"function\" (other types are ignored)"}),
    "function": FunctionDef.model_json_schema()}}
TOOLS_SCHEMA = {"anyOf": [{"type": "array", "items": TOOL_SCHEMA}, {"type": "null"}],
                "description": "Function tools ({type: \"function\", function: {name, "
                               "description, parameters}}; the flat Responses form is also "
                               "read). Built-in tool types are dropped."}
TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"type": "string", "enum": ["auto", "none", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}},
    {"type": "null"}],
    "description": "\"auto\" (default with tools), \"none\", \"required\" (a call is "
                   "enforced by a grammar), or a named function among `tools`."}
RESPONSE_FORMAT_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["json_schema"]},
        "json_schema": {"type": "object", "properties": {
            "name": nullable({"type": "string"}), "schema": {"type": "object"},
            "strict": nullable({"type": "boolean"})}}}},
    {"type": "null"}],
    "description": "Structured output, enforced by a grammar: json_object, or json_schema "
                   "with a JSON Schema."}


Tools = described(TOOLS_SCHEMA)
ToolChoice = described(TOOL_CHOICE_SCHEMA)
ResponseFormat = described(RESPONSE_FORMAT_SCHEMA)


class StreamOptions(Body):
    include_usage: Optional[bool] = Field(False, description=(
        "Send the usage in one more chunk with `choices: []` before [DONE]."))


class GenerationFields(SamplingFields):
    n: Optional[Int] = Field(1, ge=1, json_schema_extra={"maximum": 1},
                             description="Only 1 (one completion per request).")
    stop: StringOrStrings = Field(None, description="Stop strings (not included in the output).")
    stream_options: Optional[StreamOptions] = Field(None, description="Only with stream: true.")
    response_format: ResponseFormat = None


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1}, description=(
        "The conversation, rendered with the model's chat template."))
    max_tokens: Optional[Int] = Field(None, ge=1, description="Tokens to generate at most.")
    max_completion_tokens: Optional[Int] = Field(None, ge=1, description=(
        "Same as max_tokens (wins when both are given)."))
    logprobs: Optional[bool] = Field(False, description="Return each token's logprob.")
    top_logprobs: Optional[Int] = Field(None, ge=0, le=20, description=(
        "Alternatives per token with their logprobs."))
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Optional[bool] = Field(True, description=(
        "With an enforced tool call: allow more than one call."))


Prompt = described({
    "anyOf": [{"type": "string", "minLength": 1},
              {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
              {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}],
    "description": "One prompt: text, token ids, or a one-element array of either."})
CompletionLogprobs = described({
    "anyOf": [{"type": "integer", "minimum": 0, "maximum": 20}, {"type": "boolean"},
              {"type": "null"}],
    "description": "Alternatives per token to return (true: the chosen token only)."})


class CompletionRequest(GenerationFields):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: Optional[Int] = Field(None, ge=1, description="Tokens to generate at most.")
    logprobs: CompletionLogprobs = None
    echo: Optional[bool] = Field(False, description="Not supported (true is a 400).")


# --- responses -------------------------------------------------------------------------


class PromptTokensDetails(Out):
    cached_tokens: int = Field(description="Prompt tokens read from the prompt cache.")


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class ToolCallOut(Out):
    id: str
    type: Literal["function"]
    function: dict[str, str] = Field(description="{name, arguments (a JSON string)}")


class AssistantMessage(Out):
    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: Optional[str] = Field(None, description="A thinking model's reasoning.")
    reasoning: Optional[str] = Field(None, description="The same, under mlx-lm's name.")
    tool_calls: Optional[list[ToolCallOut]] = None


FINISH = Literal["stop", "length", "tool_calls"]


class ChatChoice(Out):
    index: int
    message: AssistantMessage
    logprobs: Optional[dict[str, Any]] = Field(None, description="{content: [{token, logprob, "
                                                                 "bytes, id, top_logprobs}]}")
    finish_reason: FINISH


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(Out):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = Field(None, description=(
        "{tokens, token_logprobs, top_logprobs, text_offset}"))
    finish_reason: FINISH


class TextCompletion(Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[CompletionChoice]
    usage: Usage


# --- streamed chunks (text/event-stream) -------------------------------------------------

_ERROR_FRAME = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"]}}}


def _chunk(obj: str, choice: dict) -> dict:
    return {"anyOf": [{"type": "object", "required": ["id", "object", "created", "model",
                                                      "choices"], "properties": {
        "object": {"type": "string", "enum": [obj]},
        "choices": {"type": "array", "items": choice},
        "usage": {"anyOf": [{"type": "object", "required": [
            "prompt_tokens", "completion_tokens", "total_tokens"]}, {"type": "null"}]}}},
        _ERROR_FRAME]}


_FINISH = {"anyOf": [{"type": "string", "enum": ["stop", "length", "tool_calls"]},
                     {"type": "null"}]}
CHAT_EVENTS = sse_events(_chunk("chat.completion.chunk", {
    "type": "object", "required": ["index", "delta", "finish_reason"], "properties": {
        "delta": {"type": "object", "properties": {
            "role": {"type": "string"}, "content": {"type": "string"},
            "reasoning_content": {"type": "string"}, "tool_calls": {"type": "array"}}},
        "finish_reason": _FINISH}}), done=True)
COMPLETION_EVENTS = sse_events(_chunk("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
        "text": {"type": "string"}, "finish_reason": _FINISH}}), done=True)
