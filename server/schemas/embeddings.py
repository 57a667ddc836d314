"""OpenAI embeddings: request and response models."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from .common import Body, Int, Out, described

TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
TEXT = {"type": "string", "minLength": 1}
INPUT_SCHEMA = {"anyOf": [
    TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 2048},
    TOKENS, {"type": "array", "items": TOKENS, "minItems": 1, "maxItems": 2048}],
    "description": "A string, a list of strings, a list of token ids or a list of lists of "
                   "token ids (at most 2048 inputs, each within the model's context)."}


class EmbeddingRequest(Body):
    input: described(INPUT_SCHEMA) = Field(description="What to embed.")
    model: Optional[str] = Field(None, description=(
        "The model when the server serves several (unknown: 404; absent: the first listed). "
        "One model served: accepted and ignored."))
    dimensions: Optional[Int] = Field(None, ge=1, description=(
        "Keep the first N components, then renormalise (Matryoshka); at most the model's "
        "hidden size."))
    encoding_format: Optional[Literal["float", "base64"]] = Field("float", description=(
        "float: a JSON array; base64: the little-endian float32 bytes, base64-encoded."))
    user: Optional[str] = Field(None, description="Accepted and ignored.")


class Embedding(Out):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="The vector (or its base64 bytes).")


class EmbeddingUsage(Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Out):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
