"""Several models in one server: load on first use, LRU eviction under one memory budget.

    pool = ModelPool(base_config, models_config)     # server.models_catalog.ModelsConfig
    pool.start()                                     # pins load now; the idle-TTL thread
    app = create_app(pool, security)                 # app.state.server is the pool

Each model gets what a single-model server has: its own `ServerState` (its own
`engine.Engine`, prompt cache, adapters and batch) on its own gateway worker thread
(MLX streams are per thread: a model is loaded, stepped and dropped on its thread).
The pool only decides which models are resident and refuses what cannot fit:

- **one budget** (`--models-memory-gb`) counts the weights of the resident (and
  loading) models, their prompt caches, what every running request reserves (the peak
  of its prompt + max_tokens beyond the weights, KV and working memory, as memory
  admission predicts it: `request_bytes`; from the moment it is admitted until its
  generation ends and its HTTP answer is written), and once the runtime's fixed slack;
- a request for a model that is not resident loads it (once: concurrent requests wait
  on the same load); to make room, idle models are unloaded least recently used first;
  a model with a running request, a model loading and a `--pin`ned one never are;
- what still does not fit is refused with 503 + `Retry-After` in the protocol's shape
  (a request without max_tokens instead gets the memory that is free: its generation may
  end at "length" sooner than the model's context);
- `--model-idle-ttl S` unloads a model idle for S seconds (never a pinned one).

A request holds a `server.models_lease.Lease` on its model (`state_for`) from the
moment its `model` field is read until its generation has finished and its answer is
written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
import time
from concurrent.futures import Future
from typing import Optional

from .errors import APIError
from .models_lease import Lease
from .store import ResponseStore

log = logging.getLogger("engine-serve")

RETRY_AFTER_S = 2


def request_bytes(admission, tokens: int) -> int:
    """What one running request of `tokens` (prompt + max_tokens) reserves: its peak
    beyond the weights as memory admission predicts it (KV in 256-token steps, attention
    scores and activations of a prefill chunk, the copy while the cache grows), less the
    runtime's fixed slack (`ModelPool.runtime_bytes`, counted once)."""
    return (admission.predicted_peak(tokens) - admission.weights
            - admission.FIXED_SLACK[admission.backend])


def unknown_model(name, known: list) -> APIError:
    shown = ", ".join(repr(n) for n in known[:10]) + (", ..." if len(known) > 10 else "")
    label = repr(name) if len(str(name)) <= 200 else repr(str(name)[:200] + "...")
    return APIError(404, f"model {label} not found; this server serves {shown} "
                         "(GET /v1/models lists them)",
                    type="invalid_request_error", code="model_not_found", param="model")


def no_room(message: str) -> APIError:
    err = APIError(503, message + "; retry shortly", type="overloaded_error",
                   code="models_memory_full")
    err.headers = {"Retry-After": str(RETRY_AFTER_S)}
    return err


@dataclasses.dataclass(eq=False)
class Slot:
    """One catalog model: resident or not."""
    pool: "ModelPool"
    entry: object                       # server.models_catalog.ModelEntry
    state: object = None                # ServerState while resident
    loading: Optional[Future] = None    # the load under way (requests wait on it)
    estimate: int = 0                   # the weights' bytes counted while it loads
    leases: list = dataclasses.field(default_factory=list)
    last_used: float = 0.0
    loaded_at: Optional[float] = None
    loads: int = 0
    evictions: int = 0

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def pinned(self) -> bool:
        return self.name in self.pool.models.pins

    def prune(self) -> list:
        self.leases = [le for le in self.leases if le.active]
        return self.leases

    @property
    def weights_bytes(self) -> int:
        """Its weights (with mounted adapters) while resident; the estimate while loading."""
        state = self.state
        if state is not None:
            return state.admission.weights
        return self.estimate if self.loading is not None else 0

    def cache_bytes(self) -> int:
        pc = getattr(self.state, "prompt_cache", None)
        return pc.bytes if pc is not None else 0

    def reserved_bytes(self) -> int:
        return sum(le.reserved for le in self.prune())

    def idle(self) -> bool:
        return (self.state is not None and self.loading is None and not self.pinned
                and not self.prune())


class ModelPool:
    """The models, their slots and the budget (see the module docstring). Its public
    attributes stand in for a `ServerState`'s where the app reads them (`config`,
    `max_position`, `store`)."""

    several = True                  # (server.models_lease.pool_of tells it from a ServerState)

    def __init__(self, config, models, wrap_model=None):
        self.config = config            # server.state.ServerConfig: the shared flags
        self.models = models            # server.models_catalog.ModelsConfig
        self.wrap_model = wrap_model    # (tests) wraps each loaded model, as build_state's
        self.budget_bytes = models.memory_budget_bytes
        self.store = ResponseStore()     # one store: a response id is the server's
        self.started_at = int(time.time())
        self.slots = {e.name: Slot(self, e) for e in models.models}
        ctxs = [e.context_length for e in models.models if e.context_length]
        self.max_position = max(ctxs) if ctxs else None
        self.lock = threading.RLock()
        self.shedding: Optional[BaseException] = None
        self.closing = 0                # bytes of evicted models whose workers are closing
        self.closing_bytes: dict = {}
        self.rejected = 0               # requests refused 503 for memory
        self.load_failures = 0
        self.loads = 0
        self.evictions = {"lru": 0, "idle_ttl": 0}
        self._stop = threading.Event()
        self._janitor: Optional[threading.Thread] = None

    # --- names ---------------------------------------------------------------------

    @property
    def names(self) -> list:
        return list(self.slots)

    @property
    def model_id(self) -> str:
        """The default model's name (the first listed: a request without `model`)."""
        return self.models.default.name

    @property
    def model_dir(self) -> str:
        return self.models.default.path

    def slot_for(self, name) -> Slot:
        """The slot a request's `model` field names (absent: the first model); 404 else."""
        if name is None:
            return self.slots[self.models.default.name]
        entry = self.models.entry(name)
        if entry is None:
            raise unknown_model(name, self.names)
        return self.slots[entry.name]

    # --- accounting ------------------------------------------------------------------

    def used_bytes(self) -> int:
        with self.lock:
            return self.closing + self.runtime_bytes() + sum(
                s.weights_bytes + s.cache_bytes() + s.reserved_bytes()
                for s in self.slots.values())

    def runtime_bytes(self) -> int:
        """The runtime's fixed working memory, counted once while any model is resident
        (memory admission's calibrated slack: ~1 MB on CPU, ~1.1 GB on CUDA)."""
        return max((s.state.admission.FIXED_SLACK[s.state.admission.backend]
                    for s in self.slots.values() if s.state is not None), default=0)

    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes()

    def _make_room(self, need: int, keep: Slot) -> tuple:
        """Evict idle models (least recently used first) until `need` bytes are free;
        (fits, evicted states). Nothing is evicted when even all of them would not make
        room. Under the lock."""
        free = self.free_bytes()
        if free >= need:
            return True, []
        idle = sorted((s for s in self.slots.values() if s is not keep and s.idle()),
                      key=lambda s: s.last_used)
        chosen, freed = [], 0
        for s in idle:
            freed += s.weights_bytes + s.cache_bytes()     # (once its worker has closed)
            chosen.append(s)
            if free + freed >= need:
                # the caller claims `need - free` of the freed bytes (it waits for the
                # workers to close before using them); the rest counts as closing
                claim, out = need - free, []
                for c in chosen:
                    held = c.weights_bytes + c.cache_bytes()
                    out.append(self._evict(c, "lru", max(0, held - claim)))
                    claim = max(0, claim - held)
                return True, out
        return False, []

    def _evict(self, slot: Slot, reason: str, closing: int):
        """Take a model out of the pool (under the lock); its worker is closed by the
        caller, outside the lock (`_close`); until then `closing` of its bytes (those
        no one has claimed) still count."""
        state, slot.state, slot.loaded_at = slot.state, None, None
        self.closing += closing
        self.closing_bytes[id(state)] = closing
        slot.evictions += 1
        self.evictions[reason] += 1
        log.info("model %s unloaded (%s)", slot.name, reason)
        return state

    def _close(self, states) -> None:
        """Stop the evicted models' workers and free their memory (any thread)."""
        if not states:
            return
        keys = [id(st) for st in states]
        for st in states:
            st.gateway.close()
            disk = getattr(st.engine, "disk_cache", None)
            if disk is not None:
                disk.flush()      # its last answers' files, for a later load to read
        del states[:]
        gc.collect()
        import mlx.core as mx
        mx.clear_cache()
        with self.lock:
            for k in keys:
                self.closing -= self.closing_bytes.pop(k, 0)

    # --- leases -------------------------------------------------------------------------

    async def acquire(self, name) -> Lease:
        """A lease on the model `name` names, loading it first if needed."""
        slot = self.slot_for(name)
        with self.lock:
            if self.shedding is not None:
                raise self.shedding
            lease = Lease(slot)
            slot.leases.append(lease)
            slot.last_used = time.monotonic()
            evicted: list = []
            if slot.state is None and slot.loading is None:
                fits, evicted = self._make_room(slot.entry.weights_bytes, slot)
                if not fits:
                    lease.release()
                    slot.prune()
                    self.rejected += 1
                    raise no_room(self._short(slot.entry.weights_bytes,
                                              f"loading model {slot.name!r}"))
                slot.estimate = slot.entry.weights_bytes
                slot.loading = Future()
                threading.Thread(target=self._load, args=(slot, evicted), daemon=True,
                                 name=f"load-{slot.name[:40]}").start()
            fut = slot.loading
        if fut is not None:
            try:
                await asyncio.wrap_future(fut)
            except APIError:
                lease.release()
                raise
        return lease

    def _short(self, need: int, what: str) -> str:
        return (f"{what} needs {need / 1e9:.3f} GB but the models' memory budget has "
                f"{max(0, self.free_bytes()) / 1e9:.3f} of {self.budget_bytes / 1e9:.3f} GB "
                "free (the other models are busy or pinned)")

    def _load(self, slot: Slot, evicted: list) -> None:
        """Load one model (its own thread; the model itself loads on its new worker)."""
        from .gateway import Gateway
        from .state import build_state

        fut = slot.loading
        self._close(evicted)          # the evicted models' memory first
        gateway = Gateway(name=f"engine-{slot.name[:40]}")
        try:
            state = build_state(self.state_config(slot.entry), gateway,
                                wrap_model=self.wrap_model)
        except Exception as e:        # a broken folder, a model we cannot load
            gateway.close()
            log.error("model %s failed to load: %s: %s", slot.name, type(e).__name__, e)
            with self.lock:
                slot.loading = None
                self.load_failures += 1
            err = APIError(503, f"model {slot.name!r} could not be loaded: "
                                f"{getattr(e, 'message', None) or e}",
                           type="server_error", code="model_load_failed")
            fut.set_exception(err)
            return
        state.store = self.store
        if self.shedding is not None:        # (shutting down meanwhile)
            state.gateway.shed(self.shedding)
        with self.lock:
            slot.state, slot.loading = state, None
            slot.loaded_at = time.monotonic()
            slot.loads += 1
            self.loads += 1
        log.info("model %s loaded (%.3f GB)", slot.name, slot.weights_bytes / 1e9)
        fut.set_result(state)

    def state_config(self, entry):
        """A model's `ServerConfig`: the shared flags, its directory and name, its
        admission budget (`--memory-budget`, else the pool's: its ceiling is what one
        request could use alone) and its prompt-cache share of the pool's budget."""
        cache = self.config.prompt_cache_bytes
        if cache is None:
            cache = int(self.budget_bytes * self.models.prompt_cache_share)
        return dataclasses.replace(self.config, model=entry.path, model_id=entry.name,
                                   memory_budget_bytes=(self.config.memory_budget_bytes
                                                        or self.budget_bytes),
                                   prompt_cache_bytes=cache, adapter=None)

    async def reserve(self, lease: Lease, state, prompt_tokens: int, max_tokens: int,
                      uncapped: bool) -> int:
        adm = state.admission

        def cost(n: int) -> int:
            return request_bytes(adm, prompt_tokens + n)
        need = cost(max_tokens)
        with self.lock:
            lease.reserved = 0
            fits, evicted = self._make_room(need, lease.slot)
            if not fits and uncapped:        # as much as is free (room for one token at least)
                fits, evicted = self._make_room(cost(1), lease.slot)
                if fits:
                    free = self.free_bytes() + sum(self.closing_bytes.get(id(st), 0)
                                                   for st in evicted)
                    lo, hi = 1, max_tokens
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        lo, hi = (mid, hi) if cost(mid) <= free else (lo, mid - 1)
                    max_tokens, need = lo, cost(lo)
            if fits:
                lease.reserved = need
            else:
                self.rejected += 1
        if evicted:
            await asyncio.to_thread(self._close, evicted)
        if not fits:
            raise no_room(self._short(need, f"a request of {prompt_tokens + max_tokens} "
                                            f"tokens on {lease.slot.name!r}"))
        return max_tokens

    # --- start, idle TTL, shutdown ---------------------------------------------------------

    def start(self) -> "ModelPool":
        """Load the pinned models (now, in order), then start the idle-TTL thread."""
        for name in self.models.pins:
            slot = self.slots[name]
            with self.lock:
                fits, _ = self._make_room(slot.entry.weights_bytes, slot)
                if not fits:
                    raise MemoryError(f"--pin {name}: its weights "
                                      f"({slot.entry.weights_bytes / 1e9:.3f} GB) do not fit "
                                      f"the models' memory budget with the other pins")
                slot.estimate = slot.entry.weights_bytes
                slot.loading = fut = Future()
            self._load(slot, [])
            slot.last_used = time.monotonic()
            if slot.state is None:
                raise RuntimeError(f"--pin {name}: {fut.exception()}")
        if self.models.idle_ttl_s:
            self._janitor = threading.Thread(target=self._expire_loop, daemon=True,
                                             name="models-idle-ttl")
            self._janitor.start()
        return self

    def _expire_loop(self) -> None:
        ttl = self.models.idle_ttl_s
        every = min(max(ttl / 4, 0.05), 5.0)
        while not self._stop.wait(every):
            self.expire_idle(ttl)

    def expire_idle(self, ttl: float) -> list:
        """Unload the models idle for `ttl` seconds; their names."""
        now = time.monotonic()
        with self.lock:
            gone = [s for s in self.slots.values() if s.idle() and now - s.last_used >= ttl]
            states = [self._evict(s, "idle_ttl", s.weights_bytes + s.cache_bytes())
                      for s in gone]
        self._close(states)
        return [s.name for s in gone]

    def resident(self) -> list:
        with self.lock:
            return [s for s in self.slots.values() if s.state is not None]

    def shed(self, error: BaseException) -> None:
        """SIGTERM (server.shutdown): no new loads; each resident model's gateway sheds."""
        self.shedding = error
        for s in self.resident():
            s.state.gateway.shed(error)

    def abandon(self, error: BaseException) -> None:
        for s in self.resident():
            s.state.gateway.abandon(error)

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            states = [s.state for s in self.slots.values() if s.state is not None]
            for s in self.slots.values():
                s.state = None
        self._close(states)

    # --- /stats --------------------------------------------------------------------------

    def stats(self) -> dict:
        from .models_admin import pool_stats
        return pool_stats(self)

    def metrics_collector(self):
        from .models_admin import PoolCollector
        return PoolCollector(self)
