"""`GET /` and `GET /chat`: a self-contained chat page (no external assets).

The page (`server/static/chat.html`, shipped inside the package) streams from
`/v1/chat/completions` on the same server: conversation history, a system
prompt, sampling controls, a stop button (it aborts the request; the server
cancels the generation when the client goes away), reasoning shown apart from
the answer, tool calls, tokens/s, and an attached image (sent as an `image_url` data: URL
to a model with a vision tower). With `--api-key` the page itself loads
without a key (it holds no data); its requests send the key typed into it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

PATHS = ("/", "/chat")


@lru_cache(maxsize=1)
def page() -> str:
    return files("server").joinpath("static", "chat.html").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def page_headers() -> dict:
    """No-cache, and a Content-Security-Policy that lets the page run only its own inline
    script (by hash) and style, talk only to this server, and never be framed."""
    def digests(tag):
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", page(), flags=re.S)
        return " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(b.encode()).digest())
                        .decode() for b in bodies)
    csp = (f"default-src 'none'; script-src {digests('script')}; style-src {digests('style')}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    return {"Cache-Control": "no-cache", "Content-Security-Policy": csp,
            "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"}


async def chat_page(request: Request):
    return HTMLResponse(page(), headers=page_headers())


async def no_icon(request: Request):
    return Response(status_code=204)


def install(app) -> None:
    for path in PATHS:
        app.router.add_api_route(path, chat_page, methods=["GET"], include_in_schema=False)
    app.router.add_api_route("/favicon.ico", no_icon, methods=["GET"],   # browsers ask for it
                             include_in_schema=False)
