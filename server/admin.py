"""Admin routes: /health, /v1/models, /stats, /v1/adapters."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError, bad_request, from_exception
from .models_admin import model_card, model_cards
from .models_lease import pool_of, state_for
from .schemas.admin import AdapterMount
from .security import confine_adapter_dir

HEALTH = b'{"status": "ok"}'   # the exact bytes mlx_lm.server sends


async def health(request: Request):
    return Response(HEALTH, media_type="application/json")


def _model_card(state) -> dict:
    """The model entry. `context_length` (the name OpenRouter / LM Studio clients read)
    and `max_model_len` (vLLM's) are the model's trained context, the config's
    `max_position_embeddings`; `context_window` is the longest context this server's
    memory admission accepts (it can be shorter)."""
    return {"id": state.model_id, "object": "model", "created": state.started_at,
            "owned_by": "mlx-parity", "context_length": state.max_position,
            "max_model_len": state.max_position, "context_window": state.ceiling,
            "max_position_embeddings": state.max_position, "model_type": state.model_type}


async def models(request: Request):
    pool = pool_of(request.app)
    if pool is not None:
        return JSONResponse({"object": "list", "data": model_cards(pool)})
    state = request.app.state.server
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model(request: Request):
    state = request.app.state.server
    mid = request.path_params["model_id"]
    pool = pool_of(request.app)
    if pool is not None:
        return JSONResponse(model_card(pool, pool.slot_for(mid)))
    if mid != state.model_id:
        raise APIError(404, f"model {mid!r} not found (serving {state.model_id!r})",
                       type="not_found_error")
    return JSONResponse(_model_card(state))


async def stats(request: Request):
    return JSONResponse(request.app.state.server.stats())


async def list_adapters(request: Request):
    pool = pool_of(request.app)
    if pool is not None:     # several models: each resident model's own adapters
        return JSONResponse({"object": "list", "adapters": [], "default": [], "models": {
            s.name: {"adapters": s.state.adapters.list(),
                     "default": list(s.state.default_adapters)}
            for s in pool.resident() if s.state is not None}})
    state = request.app.state.server
    return JSONResponse({"object": "list", "adapters": state.adapters.list(),
                         "default": list(state.default_adapters)})


async def mount_adapter(request: Request, validated: AdapterMount):
    state = await state_for(request, validated.model)
    aid, path, scale = validated.id, validated.path, validated.scale
    if not path:
        raise bad_request("path required: the adapter directory (adapters.safetensors + "
                          "adapter_config.json)", param="path")
    path = confine_adapter_dir(path, request.app.state.security)   # resolved, in a root
    if not aid:
        from pathlib import Path
        aid = Path(path).name

    def mount():
        m = state.adapters.mount(aid, path, scale)
        state.refresh_admission()
        return m
    # on the L1 runners a mount runs between two steps: a new adapter is off for every row
    # (a wrapped projection gives its base output bit for bit), so the running requests go on
    # untouched; on the fast runner (whose step changes with the model's modules) it waits for
    # the running requests, like an unmount
    run = (state.gateway.between_steps if state.engine.fast_step is None
           else state.gateway.call_async)
    try:
        m = await run(mount)
    except ValueError as e:                          # (engine.adapters.registry.AdapterRequestError)
        raise from_exception(e) from None
    return JSONResponse({"id": m.id, "path": m.path, "mounted_layers": m.mounted_layers,
                         "rank": m.rank, "scale": m.scale, "size_bytes": m.size_bytes})


async def unmount_adapter(request: Request):
    aid = request.path_params["adapter_id"]
    pool = pool_of(request.app)
    if pool is not None and pool.slot_for(request.query_params.get("model")).state is None:
        raise APIError(404, f'no adapter "{aid}" is mounted (the model is not loaded)',
                       type="not_found_error")
    state = await state_for(request, request.query_params.get("model"))
    if aid not in state.adapters.mounted:
        raise APIError(404, f'no adapter "{aid}" is mounted', type="not_found_error")

    def unmount():
        out = state.adapters.unmount(aid)
        if aid in state.default_adapters:
            state.default_adapters = tuple(a for a in state.default_adapters if a != aid)
        state.refresh_admission()
        return out
    return JSONResponse(await state.gateway.call_async(unmount))


async def index(request: Request):
    return JSONResponse({"object": "list", "endpoints": [
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/embeddings",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/models",
        "GET /v1/adapters", "POST /v1/adapters", "DELETE /v1/adapters/{id}", "GET /stats",
        "GET /metrics", "GET /health", "GET /openapi.json", "GET / (chat page)"]})
