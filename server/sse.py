"""Server-sent-event framing.

OpenAI chat/completions: ``data: <json>\\n\\n`` per chunk, then ``data: [DONE]``.
Anthropic and Responses: ``event: <name>\\ndata: <json>\\n\\n``.
"""

from __future__ import annotations

import json

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data(obj) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


def event(name: str, obj) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj).encode() + b"\n\n"


def response(iterator) -> StreamingResponse:
    return StreamingResponse(iterator, media_type="text/event-stream", headers=HEADERS)
