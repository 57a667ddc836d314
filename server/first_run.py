"""What a first-time user sees: the ready text and the one-time compile notice.

`ready_text(state, url)` is what `engine-serve` prints once it listens: the
ready line, the base URL for SDKs, a copy-paste `curl`, the chat page's URL,
and, for the built-in model, that its weights are random. `FirstRequestNotice`
logs once per process, on the first generation request, that MLX compiles the
kernels it has not built yet (on a CPU it caches them on disk, so the first
request on a fresh machine can take tens of seconds, later ones do not).
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

from .metrics import protocol_of

log = logging.getLogger("engine-serve")

COMPILE_NOTICE = ("first generation request: MLX compiles the kernels it has not built on this "
                  "machine yet (cached on disk afterwards), so this one can take several "
                  "seconds longer")


def curl_example(url: str, model_id: str, api_key: bool) -> str:
    body = json.dumps({"model": model_id, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    auth = ' -H "Authorization: Bearer $API_KEY"' if api_key else ""
    return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(body)}")


def is_builtin(state) -> bool:
    from starter import cache_root
    try:
        return Path(state.model_dir).resolve().parent == cache_root().resolve()
    except OSError:
        return False


def ready_text(state, url: str, first_line: str) -> str:
    lines = [first_line,
             f"  SDK base URL: {url}/v1   (OpenAI; the Anthropic SDK takes {url})",
             f"  chat page:    {url}/",
             f"  metrics:      {url}/metrics",
             f"  try:          {curl_example(url, state.model_id, bool(state.config.api_key))}"]
    if is_builtin(state):
        lines.append("  note: this is the built-in tiny model; its weights are random, so it "
                     "proves the plumbing and answers gibberish. Serve a real model with "
                     "--model <directory or Hugging Face repo id>.")
    return "\n".join(lines)


class FirstRequestNotice:
    """ASGI middleware: logs COMPILE_NOTICE on the first generation request, once."""

    def __init__(self, app):
        self.app = app
        self.said = False

    async def __call__(self, scope, receive, send):
        if (not self.said and scope["type"] == "http" and scope["method"] == "POST"
                and protocol_of(scope["path"]) != "other"
                and not scope["path"].endswith("/count_tokens")):
            self.said = True
            log.warning(COMPILE_NOTICE)
        return await self.app(scope, receive, send)
