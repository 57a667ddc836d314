"""What a server of several models shows: /v1/models cards, /stats `models`, /metrics.

/stats (several models):

    {"server": {...}, "models": {"memory_budget_bytes", "used_bytes", "weights_bytes",
     "reserved_bytes", "runtime_bytes", "prompt_cache_bytes", "configured", "resident", "loading",
     "pinned", "idle_ttl_s", "loads", "evictions": {"lru", "idle_ttl"}, "load_failures",
     "rejected", "per_model": {name: {...}}}, "loaded": {name: <that model's /stats>},
     "response_store": {...}}

`per_model` lists the models that are resident, loading or were ever loaded (not every
folder of a large --models-dir); `loaded` has each resident model's own single-model
/stats (its prompt cache, batch, queue, admission).
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .metrics import GATEWAY_COUNTERS, PROMPT_CACHE


def model_card(pool, slot) -> dict:
    """A model's /v1/models entry: `context_length` (and `max_model_len`,
    `max_position_embeddings`) is its trained context from config.json; `context_window`
    the longest context memory admission accepts for it alone (known once loaded)."""
    e, state = slot.entry, slot.state
    return {"id": e.name, "object": "model", "created": pool.started_at,
            "owned_by": "mlx-parity", "context_length": e.context_length,
            "max_model_len": e.context_length, "max_position_embeddings": e.context_length,
            "context_window": state.ceiling if state is not None else None,
            "model_type": e.model_type, "loaded": state is not None,
            "pinned": slot.pinned}


def model_cards(pool) -> list:
    return [model_card(pool, s) for s in list(pool.slots.values())]


def _slot_stats(slot, now: float) -> dict:
    return {"loaded": slot.state is not None, "loading": slot.loading is not None,
            "pinned": slot.pinned, "active_requests": len(slot.prune()),
            "weights_bytes": slot.weights_bytes, "reserved_bytes": slot.reserved_bytes(),
            "prompt_cache_bytes": slot.cache_bytes(),
            "idle_s": round(now - slot.last_used, 3) if slot.last_used else None,
            "loads": slot.loads, "evictions": slot.evictions}


def pool_stats(pool) -> dict:
    now = time.monotonic()
    with pool.lock:
        slots = list(pool.slots.values())
        touched = [s for s in slots if s.state is not None or s.loading is not None or s.loads]
        per = {s.name: _slot_stats(s, now) for s in touched}
        live = [s for s in slots if s.state is not None]
        models = {
            "memory_budget_bytes": pool.budget_bytes, "used_bytes": pool.used_bytes(),
            "weights_bytes": sum(p["weights_bytes"] for p in per.values()),
            "reserved_bytes": sum(p["reserved_bytes"] for p in per.values()),
            "runtime_bytes": pool.runtime_bytes(),
            "prompt_cache_bytes": sum(p["prompt_cache_bytes"] for p in per.values()),
            "configured": len(slots), "default": pool.models.default.name,
            "resident": [s.name for s in live],
            "loading": [s.name for s in slots if s.loading is not None],
            "pinned": list(pool.models.pins), "idle_ttl_s": pool.models.idle_ttl_s,
            "loads": pool.loads, "evictions": dict(pool.evictions),
            "load_failures": pool.load_failures, "rejected": pool.rejected,
            "per_model": per}
    return {"server": {"owner": pool.config.owner, "started_at": pool.started_at,
                       "models": len(slots), "default_model": pool.models.default.name},
            "models": models,
            "loaded": {s.name: s.state.stats() for s in live if s.state is not None},
            "response_store": pool.store.stats()}


def _gauge(name, help_, value):
    return GaugeMetricFamily(name, help_, value=value)


class PoolCollector:
    """The pool's gauges and counters, and each resident model's generation, queue and
    prompt-cache series labelled `model`, read at scrape time."""

    def __init__(self, pool):
        self.pool = pool

    def describe(self):
        return []

    def collect(self):
        st = pool_stats(self.pool)
        m = st["models"]
        yield _gauge("engine_models_configured", "models this server can serve", m["configured"])
        yield _gauge("engine_models_resident", "models loaded now", len(m["resident"]))
        yield _gauge("engine_models_loading", "models loading now", len(m["loading"]))
        yield _gauge("engine_models_memory_budget_bytes", "the models' memory budget",
                     m["memory_budget_bytes"])
        yield _gauge("engine_models_memory_used_bytes", "weights + prompt caches + reserved "
                     "KV of the resident models", m["used_bytes"])
        yield _gauge("engine_models_weights_bytes", "weights of the resident models",
                     m["weights_bytes"])
        yield _gauge("engine_models_reserved_bytes", "KV and working memory reserved by "
                     "running requests", m["reserved_bytes"])
        yield CounterMetricFamily("engine_models_loads", "model loads", value=m["loads"])
        ev = CounterMetricFamily("engine_models_evictions", "models unloaded", labels=["reason"])
        for reason, n in m["evictions"].items():
            ev.add_metric([reason], n)
        yield ev
        yield CounterMetricFamily("engine_models_load_failures", "model loads that failed",
                                  value=m["load_failures"])
        yield CounterMetricFamily("engine_models_rejected", "requests refused (503): the "
                                  "models' memory budget was full", value=m["rejected"])
        yield from self._per_model()
        import mlx.core as mx
        yield _gauge("engine_memory_active_bytes", "MLX active memory", mx.get_active_memory())
        yield _gauge("engine_memory_peak_bytes", "MLX peak memory since start",
                     mx.get_peak_memory())

    def _per_model(self):
        resident = GaugeMetricFamily("engine_model_resident", "1 while the model is loaded",
                                     labels=["model"])
        queue = GaugeMetricFamily("engine_queue_depth", "generations waiting for the model",
                                  labels=["model"])
        active = GaugeMetricFamily("engine_active_generations", "generations running now",
                                   labels=["model"])
        counters = [CounterMetricFamily(n, h, labels=["model"]) for n, h, _ in GATEWAY_COUNTERS]
        caches = [kind(n, h, labels=["model"]) for kind, n, h, _ in PROMPT_CACHE]
        for slot in self.pool.resident():
            state = slot.state
            if state is None:
                continue
            name = slot.name
            resident.add_metric([name], 1)
            g = state.gateway.stats()
            queue.add_metric([name], g["queued"])
            active.add_metric([name], g["active"])
            for fam, (_, _, key) in zip(counters, GATEWAY_COUNTERS):
                fam.add_metric([name], g[key])
            if state.prompt_cache is not None:
                pc = state.prompt_cache.stats()
                for fam, (_, _, _, key) in zip(caches, PROMPT_CACHE):
                    fam.add_metric([name], pc[key])
        yield from (resident, queue, active, *counters, *caches)
