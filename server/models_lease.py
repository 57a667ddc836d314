"""A request's hold on one of several models (server/models_pool.py), from the request side.

    state = await state_for(request, validated.model)   # every generation route
    lease = model_lease(request, state)                 # server.chat.start: reserve, attach

A `Lease` is taken when a request's `model` field is read (`ModelPool.acquire`). While
it is active its model is never unloaded and the KV it reserved counts against the
models' budget; it ends once both its HTTP answer is written (`LeaseRelease`, an ASGI
middleware around the app) and its generation, if it queued one, has finished.
"""

from __future__ import annotations

import time
from typing import Optional

LEASES_KEY = "model_leases"     # request.state key: the leases a request holds


class Lease:
    """One request's hold on one model: the model is not evicted while the lease is
    active, and the KV the request reserved counts against the budget."""

    def __init__(self, slot):
        self.slot = slot                # server.models_pool.Slot
        self.reserved = 0               # bytes: KV + working memory (models_pool.request_bytes)
        self.job = None                 # server.gateway.GenerationJob, once queued
        self.http_open = True

    @property
    def active(self) -> bool:
        return self.http_open or (self.job is not None and not self.job.finished)

    @property
    def state(self):
        return self.slot.state

    def attach(self, job) -> None:
        self.job = job

    def release(self) -> None:
        """The HTTP request is over (its job, if any, keeps the lease until it ends)."""
        if self.http_open:
            self.http_open = False
            self.slot.last_used = time.monotonic()

    async def reserve(self, state, prompt_tokens: int, max_tokens: int,
                      uncapped: bool) -> int:
        """Reserve the memory of a request of `prompt_tokens + max_tokens` (its KV and
        working memory; evicting idle models if needed); returns the max_tokens to run with (an uncapped request's is cut to
        what is free). Raises a 503 when it cannot fit."""
        return await self.slot.pool.reserve(self, state, prompt_tokens, max_tokens, uncapped)


def pool_of(app):
    """The app's `server.models_pool.ModelPool` (None: it serves one model)."""
    st = app.state.server
    return st if getattr(st, "several", False) is True else None


async def state_for(request, name):
    """The `ServerState` that serves a request whose `model` field is `name`. One model
    served: that one, whatever the name (as before several models were possible)."""
    pool = pool_of(request.app)
    if pool is None:
        return request.app.state.server
    lease = await pool.acquire(name)
    leases = getattr(request.state, LEASES_KEY, None)
    if leases is None:
        leases = []
        setattr(request.state, LEASES_KEY, leases)
    leases.append(lease)
    return lease.state


def model_lease(request, state) -> Optional[Lease]:
    """The lease this request holds on `state`'s model (None with one model served)."""
    if request is None:
        return None
    for lease in getattr(request.state, LEASES_KEY, ()):
        if lease.state is state:
            return lease
    return None


class LeaseRelease:
    """ASGI middleware (several models only): when a request's answer is written (or its
    client has gone), its leases end their HTTP part."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = scope.setdefault("state", {})
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in st.get(LEASES_KEY, ()):
                lease.release()
