"""The FastAPI app factory: routes, error shapes, auth, CORS.

    app = create_app(state)        # state = server.state.build_state(config)

The HTTP layer only translates wire formats; every generation goes through
`server.chat.start` onto the state's single gateway queue.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from . import admin, anthropic, chat_page, metrics, openai, responses
from .first_run import FirstRequestNotice
from .errors import APIError, body_for, is_anthropic_path

log = logging.getLogger("engine-serve")
PUBLIC_PATHS = ("/health", "/favicon.ico") + chat_page.PATHS   # the page holds no data; its requests send the key


class AuthMiddleware:
    """`--api-key`: every route but /health and the chat page needs `Authorization:
    Bearer KEY` or `x-api-key: KEY` (CORS preflights pass)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["path"] in PUBLIC_PATHS
                or scope["method"] == "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is not None and hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        msg = "invalid API key" if given is not None else (
            "missing API key: send Authorization: Bearer <key> or x-api-key: <key>")
        err = APIError(401, msg, type="authentication_error", code="invalid_api_key")
        resp = JSONResponse(body_for(scope["path"], err), status_code=401)
        await resp(scope, receive, send)


def _error_response(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(body_for(request.url.path, err), status_code=err.status,
                        headers=getattr(err, "headers", None))


async def _api_error(request: Request, exc: APIError):
    return _error_response(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        err = APIError(404, f"not found: {request.method} {request.url.path}",
                       type="not_found_error")
    elif exc.status_code == 405:
        err = APIError(405, f"method {request.method} not allowed on {request.url.path}",
                       type="invalid_request_error")
    else:
        err = APIError(exc.status_code, str(exc.detail))
    return _error_response(request, err)


async def _server_error(request: Request, exc: Exception):
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                   type="api_error" if is_anthropic_path(request.url.path) else "server_error")
    return _error_response(request, err)


def create_app(state) -> FastAPI:
    app = FastAPI(title="engine-serve", docs_url=None, redoc_url=None, openapi_url=None,
                  exception_handlers={APIError: _api_error,
                                      StarletteHTTPException: _http_error,
                                      Exception: _server_error})
    app.state.server = state
    r = app.router
    r.add_api_route("/health", admin.health, methods=["GET"])
    r.add_api_route("/v1", admin.index, methods=["GET"])
    r.add_api_route("/v1/models", admin.models, methods=["GET"])
    r.add_api_route("/v1/models/{model_id:path}", admin.model, methods=["GET"])
    r.add_api_route("/stats", admin.stats, methods=["GET"])
    r.add_api_route("/v1/adapters", admin.list_adapters, methods=["GET"])
    r.add_api_route("/v1/adapters", admin.mount_adapter, methods=["POST"])
    r.add_api_route("/v1/adapters/{adapter_id}", admin.unmount_adapter, methods=["DELETE"])
    r.add_api_route("/v1/chat/completions", openai.chat_completions, methods=["POST"])
    r.add_api_route("/chat/completions", openai.chat_completions, methods=["POST"])
    r.add_api_route("/v1/completions", openai.completions, methods=["POST"])
    r.add_api_route("/v1/messages", anthropic.messages, methods=["POST"])
    r.add_api_route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"])
    r.add_api_route("/v1/responses", responses.create_response, methods=["POST"])
    r.add_api_route("/v1/responses/{response_id}", responses.get_response, methods=["GET"])
    r.add_api_route("/v1/responses/{response_id}", responses.delete_response,
                    methods=["DELETE"])
    if state.config.api_key:
        app.add_middleware(AuthMiddleware, api_key=state.config.api_key)
    chat_page.install(app)
    app.add_middleware(FirstRequestNotice)
    if state.config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    metrics.install(app, state)     # last: the outermost middleware, it also sees 401s
    return app
