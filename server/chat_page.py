"""`GET /` and `GET /chat`: a self-contained chat page (no external assets).

The page (`server/static/chat.html`, shipped inside the package) streams from
`/v1/chat/completions` on the same server: conversation history, a system
prompt, sampling controls, a stop button (it aborts the request; the server
cancels the generation when the client goes away), reasoning shown apart from
the answer, tool calls, and tokens/s. With `--api-key` the page itself loads
without a key (it holds no data); its requests send the key typed into it.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

PATHS = ("/", "/chat")


@lru_cache(maxsize=1)
def page() -> str:
    return files("server").joinpath("static", "chat.html").read_text(encoding="utf-8")


async def chat_page(request: Request):
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})


async def no_icon(request: Request):
    return Response(status_code=204)


def install(app) -> None:
    for path in PATHS:
        app.router.add_api_route(path, chat_page, methods=["GET"], include_in_schema=False)
    app.router.add_api_route("/favicon.ico", no_icon, methods=["GET"],   # browsers ask for it
                             include_in_schema=False)
