"""What a first-time user sees: the ready text and the one-time compile notice.

`ready_text(state, url)` is what `engine-serve` prints once it listens: the
ready line, the base URL for SDKs, a copy-paste `curl`, the chat page's URL,
and, for the built-in model, that its weights are random. `FirstRequestNotice`
logs, on the first generation request, that MLX compiles the kernels it has not
built yet, but only when MLX's on-disk kernel cache was cold when the server
started (`kernel_cache_cold`: MLX compiles CPU kernels into
`<tmp>/mlx/<version>/cpu` and CUDA kernels into `$MLX_PTX_CACHE_DIR`, default
`<tmp>/mlx/<version>/ptx`; once there, later processes load them).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
from pathlib import Path
from typing import Optional

from .metrics import protocol_of

log = logging.getLogger("engine-serve")

COMPILE_NOTICE = ("first generation request: MLX compiles the kernels it has not built on this "
                  "machine yet (cached on disk afterwards), so this one can take several "
                  "seconds longer")


def kernel_cache_dir() -> Optional[Path]:
    """Where MLX keeps the kernels it compiles for the default device (None: it compiles
    none at run time, as on Metal)."""
    import mlx.core as mx

    base = Path(tempfile.gettempdir()) / "mlx" / mx.__version__
    if mx.default_device() == mx.cpu:
        return base / "cpu"
    if mx.cuda.is_available():
        return Path(os.environ.get("MLX_PTX_CACHE_DIR") or base / "ptx")
    return None


def kernel_cache_cold() -> bool:
    """Whether the first generation will compile kernels (the cache is absent or empty)."""
    d = kernel_cache_dir()
    if d is None:
        return False
    try:
        return not any(d.iterdir())
    except OSError:
        return True


_cold_at_start: Optional[bool] = None


def note_kernel_cache() -> bool:
    """Record (once, before anything compiles) whether the kernel cache is cold."""
    global _cold_at_start
    if _cold_at_start is None:
        _cold_at_start = kernel_cache_cold()
    return _cold_at_start


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
    """ASGI middleware: logs COMPILE_NOTICE on the first generation request, once, when
    the kernel cache was cold at start (`note_kernel_cache`)."""

    def __init__(self, app):
        self.app = app
        self.said = not note_kernel_cache()

    async def __call__(self, scope, receive, send):
        if (not self.said and scope["type"] == "http" and scope["method"] == "POST"
                and protocol_of(scope["path"]) != "other"
                and not scope["path"].endswith("/count_tokens")):
            self.said = True
            log.warning(COMPILE_NOTICE)
        return await self.app(scope, receive, send)
