"""The route table: every operation with its request model (in the handler's
signature), its response bodies and error shapes, for FastAPI and `/openapi.json`.

    install(app)

Generation routes take a body without a Content-Type (scripts; the ASGI guard has
already refused every non-JSON type), so FastAPI's strict content-type check is off
there; admin routes require `application/json` (`server.limits.BodyGuard`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from . import admin, anthropic, embeddings, openai, responses
from .schemas import admin as A
from .schemas import anthropic as M
from .schemas import embeddings as E
from .schemas import openai as O
from .schemas import responses as R
from .schemas.common import GENERATION_ERRORS, READ_ERRORS, responses_for

OPENAPI_PATH = "/openapi.json"


DESCRIPTION = ("OpenAI chat/completions and embeddings, Anthropic Messages and OpenAI Responses on one "
               "local model or several (picked by the request's `model`). Every route but /health takes the API key (when the server has "
               "one) as `Authorization: Bearer` or `x-api-key`.")


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document without its 422 entries: a request the models refuse is a
    400 in the protocol's error shape (declared per route), never a 422."""
    if app.openapi_schema is None:
        from engine import __version__
        doc = get_openapi(title="engine-serve", version=__version__, description=DESCRIPTION,
                          routes=app.routes)
        for ops in doc.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema


def install(app: FastAPI) -> None:
    app.openapi = lambda: openapi_document(app)
    r = app.router
    gen = dict(methods=["POST"], strict_content_type=False)

    r.add_api_route("/health", admin.health, methods=["GET"], tags=["admin"],
                    responses=responses_for(A.Health, (500,)), summary="Liveness (no key)")
    r.add_api_route("/v1", admin.index, methods=["GET"], tags=["admin"],
                    responses=responses_for(A.Index, READ_ERRORS), summary="The endpoints")
    r.add_api_route("/v1/models", admin.models, methods=["GET"], tags=["admin"],
                    responses=responses_for(A.ModelList, READ_ERRORS), summary="The model")
    r.add_api_route("/v1/models/{model_id:path}", admin.model, methods=["GET"], tags=["admin"],
                    responses=responses_for(A.ModelCard, READ_ERRORS + (404,)),
                    summary="The model, by id")
    r.add_api_route("/stats", admin.stats, methods=["GET"], tags=["admin"],
                    responses=responses_for(A.Stats, READ_ERRORS),
                    summary="Cache, admission, queue and batch counters")
    r.add_api_route("/v1/adapters", admin.list_adapters, methods=["GET"], tags=["admin"],
                    responses=responses_for(A.AdapterList, READ_ERRORS),
                    summary="Mounted LoRA adapters")
    r.add_api_route("/v1/adapters", admin.mount_adapter, methods=["POST"], tags=["admin"],
                    responses=responses_for(A.Mounted, GENERATION_ERRORS),
                    summary="Mount a LoRA adapter from an --adapter-dir root")
    r.add_api_route("/v1/adapters/{adapter_id}", admin.unmount_adapter, methods=["DELETE"],
                    tags=["admin"], responses=responses_for(A.Unmounted, READ_ERRORS + (404,)),
                    summary="Unmount an adapter")
    for path in ("/v1/chat/completions", "/chat/completions"):
        r.add_api_route(path, openai.chat_completions, **gen, tags=["openai"],
                        include_in_schema=path.startswith("/v1"),
                        responses=responses_for(O.ChatCompletion, GENERATION_ERRORS,
                                                stream=O.CHAT_EVENTS),
                        summary="OpenAI chat completion")
    r.add_api_route("/v1/completions", openai.completions, **gen, tags=["openai"],
                    responses=responses_for(O.TextCompletion, GENERATION_ERRORS,
                                            stream=O.COMPLETION_EVENTS),
                    summary="OpenAI text completion")
    r.add_api_route("/v1/embeddings", embeddings.embeddings, **gen, tags=["openai"],
                    responses=responses_for(E.EmbeddingList, GENERATION_ERRORS),
                    summary="OpenAI embeddings (pooled final hidden states)")
    r.add_api_route("/v1/messages", anthropic.messages, **gen, tags=["anthropic"],
                    responses=responses_for(M.Message, GENERATION_ERRORS, anthropic=True,
                                            stream=M.EVENTS),
                    summary="Anthropic Messages")
    r.add_api_route("/v1/messages/count_tokens", anthropic.count_tokens, **gen,
                    tags=["anthropic"],
                    responses=responses_for(M.TokenCount, GENERATION_ERRORS, anthropic=True),
                    summary="Anthropic token count of a Messages request")
    r.add_api_route("/v1/responses", responses.create_response, **gen, tags=["responses"],
                    responses=responses_for(R.ResponseObject, GENERATION_ERRORS + (404,),
                                            stream=R.EVENTS),
                    summary="OpenAI Responses (previous_response_id: 404 when unknown)")
    r.add_api_route("/v1/responses/{response_id}", responses.get_response, methods=["GET"],
                    tags=["responses"],
                    responses=responses_for(R.ResponseObject, READ_ERRORS + (404,)),
                    summary="A stored response")
    r.add_api_route("/v1/responses/{response_id}", responses.delete_response,
                    methods=["DELETE"], tags=["responses"],
                    responses=responses_for(R.ResponseDeleted, READ_ERRORS + (404,)),
                    summary="Forget a stored response")
