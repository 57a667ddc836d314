"""Test helpers for servers of several models (server/models_pool.py)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import httpx


@dataclass
class PoolServed:
    url: str
    pool: object
    bg: object

    def stop(self):
        self.bg.stop()
        self.pool.close()


def start_pool(models: list, budget: int, *, models_dir=None, pins=(), idle_ttl_s=None,
               wrap_model=None, security=None, **config) -> PoolServed:
    """A real uvicorn server over a `ModelPool` of `models` (--model values)."""
    from server.app import create_app, security_for
    from server.listen import BackgroundServer
    from server.models_catalog import models_config
    from server.models_pool import ModelPool
    from server.state import ServerConfig

    cfg = ServerConfig(**config)
    mc = models_config(models, models_dir, budget, pins=pins, idle_ttl_s=idle_ttl_s)
    pool = ModelPool(cfg, mc, wrap_model=wrap_model).start()
    bg = BackgroundServer(create_app(pool, security or security_for(cfg))).start()
    return PoolServed(bg.url, pool, bg)


def chat_body(model, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return body


def stream_ids(url: str, body: dict, on_first=None) -> tuple:
    """(token ids, finish reason) of a streamed chat request with logprobs (asserts 200);
    `on_first()` runs once the first content chunk is in."""
    ids, finish, first = [], None, True
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={**body, "stream": True, "logprobs": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                lp = c.get("logprobs") or {}
                got = [e["id"] for e in lp.get("content") or ()]
                ids.extend(got)
                finish = c.get("finish_reason") or finish
                if got and first and on_first is not None:
                    first = False
                    on_first()
    return ids, finish


def chat_ids(url: str, body: dict) -> tuple:
    r = httpx.post(url + "/v1/chat/completions", json={**body, "logprobs": True}, timeout=60)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return [e["id"] for e in ch["logprobs"]["content"]], ch["finish_reason"]


class GatedModel:
    """Wraps a model: once `hold()` is called, the next forward blocks (on the model's own
    worker) until `release()`: its request stays running for as long as a test needs."""

    def __init__(self, model, tokenizer):
        object.__setattr__(self, "_inner", model)
        object.__setattr__(self, "_gate", threading.Event())
        object.__setattr__(self, "_held", threading.Event())
        object.__setattr__(self, "_armed", False)
        self._gate.set()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def hold(self):
        object.__setattr__(self, "_armed", True)
        self._gate.clear()

    def wait_held(self, timeout=30.0) -> bool:
        return self._held.wait(timeout)

    def release(self):
        object.__setattr__(self, "_armed", False)
        self._gate.set()

    def __call__(self, *a, **kw):
        if self._armed:
            self._held.set()
            self._gate.wait(30.0)
        return self._inner(*a, **kw)
