"""The FastAPI app factory: routes, error shapes, auth, CORS, limits.

    app = create_app(state, security)   # state = server.state.build_state(config)

`security` (a `server.security.SecurityConfig`: API key, CORS, hosts, adapter
roots, body limits) defaults to what `state.config` says plus the secure
defaults (kept in `app.state.security`).

The HTTP layer only translates wire formats; every generation goes through
`server.chat.start` onto the state's single gateway queue. With several models,
`state` is a `server.models_pool.ModelPool` and each request's `model` field picks
the model's state (and its gateway).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace
from typing import Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Match

from . import chat_page, metrics, routes
from .first_run import FirstRequestNotice
from .errors import APIError, body_for, from_validation, is_anthropic_path
from .limits import BodyLimits, default_json_nodes, default_prompt_chars
from .chat import cancel_generations
from .models_lease import LeaseRelease, pool_of
from .security import SecurityConfig, add_security_middleware, default_allowed_hosts

log = logging.getLogger("engine-serve")
PUBLIC_PATHS = ("/health", "/favicon.ico") + chat_page.PATHS   # the page holds no data; its requests send the key


def _error_response(request: Request, err: APIError) -> JSONResponse:
    cancel_generations(request)      # a request answered with an error leaves nothing running
    return JSONResponse(body_for(request.url.path, err), status_code=err.status,
                        headers=getattr(err, "headers", None))


async def _api_error(request: Request, exc: APIError):
    return _error_response(request, exc)


async def _validation_error(request: Request, exc: RequestValidationError):
    """A body the request models refuse: a 400 naming the field, never FastAPI's 422."""
    return _error_response(request, from_validation(exc.errors()))


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        err = APIError(404, f"not found: {request.method} {request.url.path}",
                       type="not_found_error")
    elif exc.status_code == 405:
        err = APIError(405, f"method {request.method} not allowed on {request.url.path}",
                       type="invalid_request_error")
        err.headers = {"Allow": _allowed_methods(request)}
    else:
        err = APIError(exc.status_code, str(exc.detail))
    return _error_response(request, err)


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (routes are one per method)."""
    methods = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= set(route.methods)
    return ", ".join(sorted(methods))


async def _server_error(request: Request, exc: Exception):
    ref = uuid.uuid4().hex[:12]
    log.exception("unhandled error %s on %s %s", ref, request.method, request.url.path)
    err = APIError(500, f"internal server error (reference {ref} in the server log)",
                   type="api_error" if is_anthropic_path(request.url.path) else "server_error")
    return _error_response(request, err)


def security_for(config, **overrides) -> SecurityConfig:
    """The security settings a `ServerConfig` implies, with the secure defaults."""
    limits = BodyLimits(max_body_bytes=config.max_body_bytes)
    base = dict(api_key=config.api_key or None, allowed_hosts=default_allowed_hosts(config.host),
                limits=limits)
    base.update(overrides)
    return SecurityConfig(**base)


def create_app(state, security: Optional[SecurityConfig] = None) -> FastAPI:
    app = FastAPI(title="engine-serve", docs_url=None, redoc_url=None,
                  openapi_url=routes.OPENAPI_PATH,
                  exception_handlers={APIError: _api_error,
                                      RequestValidationError: _validation_error,
                                      StarletteHTTPException: _http_error,
                                      Exception: _server_error})
    app.state.server = state
    routes.install(app)           # every route, its request model and response bodies
    security = security or security_for(state.config)
    context = getattr(state, "max_position", None)
    if security.limits.max_prompt_chars <= 0:     # 0 = derive from the model's context
        security = replace(security, limits=replace(security.limits,
                                                    max_prompt_chars=default_prompt_chars(context),
                                                    context_tokens=context or 0))
    if security.limits.max_json_nodes <= 0:
        security = replace(security, limits=replace(security.limits,
                                                    max_json_nodes=default_json_nodes(context)))
    app.state.security = security
    add_security_middleware(app, security, public_paths=PUBLIC_PATHS)
    chat_page.install(app)
    app.add_middleware(FirstRequestNotice)
    if pool_of(app) is not None:    # several models: a request's lease ends with its answer
        app.add_middleware(LeaseRelease)
    metrics.install(app, state)     # last: the outermost middleware, it also sees 401s
    return app
