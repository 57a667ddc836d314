"""Server configuration and the live state every route reads.

`ServerConfig` is what the start flags say; `build_state(config)` loads the
model on the gateway's worker thread (MLX sees one thread only), builds the
`engine.Engine` that thread owns (prompt cache, KV-quant policy, memory
admission, adapters, batching), the Responses store, and returns the
`ServerState` that `create_app` serves.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from .gateway import Gateway
from .store import ResponseStore

log = logging.getLogger("engine-serve")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerConfig:
    model: Optional[str] = None
    model_id: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8090
    memory_budget_bytes: Optional[int] = None      # None = machine RAM x 0.75
    prompt_cache_bytes: Optional[int] = None        # 0 disables; None = the budget left
    #                                       after the weights x PROMPT_CACHE_FRACTION
    prompt_cache_dir: Optional[str] = None          # also keep prefixes as files there
    prompt_cache_disk_gb: float = 20.0              # their cap, decimal GB
    kv_quant: str = "config"                        # config | off | 4 | 8 (or any valid bits)
    kv_group_size: Optional[int] = None             # None = 64, or 32 when head_dim needs it
    thinking: Optional[bool] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    max_tokens: Optional[int] = None   # None: no cap (the context left, bounded by admission)
    prompt_lookup: int = 0             # prompt-lookup speculation (0: off; engine.step.batch_lookup)
    num_draft_tokens: int = 4
    draft_model: Optional[str] = None  # a draft model (directory or repo id) for speculation
    spec_sampling: str = "exact"       # sampled drafts: exact (mlx-lm's) | rejection (engine.step.rejection)
    draft_tier: str = "l1"             # the batch rows' draft steps: l1 | l3 (engine.step.fast_draft)
    draft_max_rows: Optional[int] = None   # drafting pauses above this many decoding rows
    adapter: Optional[str] = None
    api_key: Optional[str] = None
    batch: int = 8                      # rows decoding together (1: one request at a time)
    max_queue: Optional[int] = None     # requests waiting beyond the running ones (None: default)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_grammar_ms: float = 2000.0      # a grammar compile longer than this is a 400
    max_schema_nodes: int = 10_000      # JSON nodes of a response/tool schema (400 beyond)
    template_kwargs: dict = field(default_factory=dict)
    chat_template: Optional[str] = None   # --chat-template: replaces the model's template
    prefill_step_size: int = 2048
    prefill_budget: int = -1            # engine.Engine(prefill_budget=): -1 = prefill_step_size
    allowed_origins: list = field(default_factory=lambda: ["*"])
    owner: str = "serve"
    stream_interval_ms: float = 25.0    # coalesce streamed deltas: one write per interval (0 = per token)
    levers: Optional[object] = None     # engine.levers.Levers (None = L1 defaults)
    deterministic: bool = False         # batch-invariant logits (engine.deterministic)
    warm_up: bool = True                # build the fast runner's shapes before serving (engine.step.warmup)
    warm_up_tokens: Optional[int] = None  # its long throw-away prompt (None: the disk cache's longest prefix)
    embeddings_pooling: Optional[str] = None   # last | mean (None: the checkpoint's, else last)
    allow_image_urls: bool = False      # fetch http(s) image URLs (data: URLs are always taken)
    allow_private_image_urls: bool = False   # ... from loopback/link-local/private addresses too
    max_image_bytes: int = 20 * 1024 * 1024  # an image's encoded size cap
    image_url_timeout: float = 10.0     # seconds to fetch an image URL
    tensor_parallel: bool = False       # shard over the mlx.launch ranks (server/tp.py, engine/distributed)


def default_max_queue(batch: int) -> int:
    """--max-queue's default: 8 waiting requests per row (at least 16)."""
    return max(16, 8 * max(1, int(batch or 1)))


def _dtype_name(dt) -> str:
    import mlx.core as mx
    return {mx.bfloat16: "bf16", mx.float16: "fp16", mx.float32: "fp32"}.get(dt, str(dt))


def activation_dtype(model) -> str:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    for _, v in tree_flatten(model.parameters()):
        if v.dtype in (mx.float32, mx.bfloat16, mx.float16):
            return _dtype_name(v.dtype)
    return "bf16"


class ServerState:
    def __init__(self, config: ServerConfig, gateway: Gateway, model, tokenizer, model_dir: str,
                 draft_model=None):
        from engine import Engine
        from engine import AdapterRegistry
        from engine import make_policy
        from engine import PromptCache

        self.config = config
        self.gateway = gateway
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = str(model_dir)
        self.model_id = config.model_id or Path(model_dir).name or str(model_dir)
        self.started_at = int(time.time())
        try:
            self.model_config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            self.model_config = {}
        tc = self.model_config.get("text_config") or {}
        self.model_type = getattr(model, "model_type", None) or self.model_config.get("model_type")
        self.max_position = (self.model_config.get("max_position_embeddings")
                             or tc.get("max_position_embeddings"))
        self.vocab_size = int(getattr(getattr(model, "args", None), "vocab_size", 0)
                              or self.model_config.get("vocab_size") or tc.get("vocab_size")
                              or len(tokenizer))
        from engine import checkpoint_pooling
        self.embeddings_pooling = (config.embeddings_pooling or checkpoint_pooling(model_dir)
                                   or "last")
        self.kv_options, self.kv_mode = self._kv_options()
        self.kv_policy = make_policy(model, **self.kv_options)
        self.draft_model = draft_model
        self.admission = self._admission()
        cache_bytes = (self.admission.prompt_cache_bytes() if config.prompt_cache_bytes is None
                       else config.prompt_cache_bytes)
        self.prompt_cache = PromptCache(cache_bytes) if cache_bytes > 0 else None
        self.ceiling = self.admission.max_context()
        self.adapters = AdapterRegistry(model, self.prompt_cache)
        self.default_adapters: tuple = ()
        self.store = ResponseStore()
        self.warmed = None              # engine.step.warmup.WarmUp, once run
        self.remembered = 0             # the stored prefix's tokens the tokenizer has seen
        from engine import for_tier
        self.engine = Engine(model, tokenizer, max_batch=max(1, int(config.batch or 1)),
                             prompt_cache=self.prompt_cache, admission=self.admission,
                             prefill_step_size=config.prefill_step_size, adapters=self.adapters,
                             prefill_budget=config.prefill_budget,
                             levers=config.levers, draft_model=draft_model,
                             draft_levers=for_tier(config.draft_tier) if config.draft_tier != "l1" else None,
                             draft_max_rows=config.draft_max_rows,
                             deterministic=config.deterministic, **self.kv_options)
        if config.prompt_cache_dir:
            from engine import disk_cache_for
            self.engine.disk_cache = disk_cache_for(config.prompt_cache_dir,
                                                    config.prompt_cache_disk_gb, model_dir,
                                                    self.engine)
        from engine import has_vision, preprocessor_for
        if has_vision(model):
            self.engine.image_preprocess = preprocessor_for(model, model_dir)
        gateway.engine = self.engine
        # requests waiting to start (inbox, behind a call, or in the engine; the rows
        # running, at most --batch of them, are not counted) before a new one is refused
        # with 503 + Retry-After; one bound for both lanes
        self.max_queue: int = (default_max_queue(config.batch) if config.max_queue is None
                               else int(config.max_queue))
        self.rejected = 0

    # --- KV quantization ----------------------------------------------------

    def _kv_options(self):
        from engine import VALID_BITS, KVConfigError, cache_head_dims

        mode = str(self.config.kv_quant).lower()
        if mode in ("off", "none", "bf16", "false", "0"):
            return {}, activation_dtype(self.model)
        if mode == "config":
            f = Path(self.model_dir) / "kv_config.json"
            if f.is_file():
                return {"kv_config": str(f)}, "mixed (kv_config.json)"
            return {}, activation_dtype(self.model)
        try:
            bits = int(mode)
        except ValueError:
            raise KVConfigError(f"--kv-quant must be config, off or a bit width, got {mode!r}")
        if bits not in VALID_BITS:
            raise KVConfigError(f"--kv-quant bits must be one of {VALID_BITS}, got {bits}")
        group = self.config.kv_group_size
        if group is None:
            dims = cache_head_dims(self.model)
            group = 64 if all(d % 64 == 0 for d in dims) else 32
        return {"kv_bits": bits, "kv_group_size": group, "quantized_kv_start": 0}, \
            f"uniform-kv{bits}"

    def kv_describe(self) -> dict:
        caches = self.model.make_cache()
        act = activation_dtype(self.model)
        layers: dict = {}
        glob = slide = 0
        for i, c in enumerate(caches):
            if i in self.kv_policy.layers:
                key = f"kv{self.kv_policy.layers[i][0]}"
            else:
                key = act
            layers[key] = layers.get(key, 0) + 1
            if getattr(c, "max_size", None) is not None:
                slide += 1
            else:
                glob += 1
        out = {"mode": self.kv_mode, "layers": layers,
               "attention": {"global": glob, "sliding_window": slide}}
        if "kv_group_size" in self.kv_options:
            out["group_size"] = self.kv_options["kv_group_size"]
        return out

    def refresh_admission(self) -> None:
        """Recompute the ceiling (adapters change the weight bytes). Worker thread."""
        self.admission = self._admission()
        self.ceiling = self.admission.max_context()
        self.engine.admission = self.admission

    def _admission(self):
        """Memory admission of the model (and its draft model, if any) under the budget."""
        from engine import Admission
        adm = Admission.for_model(self.model, self.config.memory_budget_bytes, self.kv_policy,
                                  prefill_step=self.config.prefill_step_size)
        return adm.with_draft(self.draft_model) if self.draft_model is not None else adm

    def check_capacity(self) -> None:
        """Refuse a new request (503, Retry-After) when the wait queue is full. Any thread."""
        if self.gateway.queued >= self.max_queue:
            from .errors import APIError
            self.rejected += 1
            err = APIError(503, f"the server is at capacity ({self.max_queue} requests "
                                "waiting); retry shortly", type="overloaded_error")
            err.headers = {"Retry-After": "1"}
            raise err

    def batch_stats(self) -> dict:
        st = self.engine.stats()
        # rows_now: rows decoding now; peak_rows: most rows in one decode forward
        rows = {"rows_now": st["rows_now"], "peak_rows": st["peak_rows"]}
        if not self.engine.batching:
            return {"configured": self.config.batch, "batched": False,
                    "active_rows": st["active_rows"] + int(st["solo_active"]), "available": False,
                    "queued": self.gateway.queued, "max_queue": self.max_queue,
                    "rejected": self.rejected, **rows}
        return {"configured": self.config.batch, "batched": self.engine.batching,
                "available": self.engine.batching, "active_rows": st["active_rows"],
                "queued": st["waiting"], "steps": st["steps"], **rows,
                "max_queue": self.max_queue, "rejected": self.rejected,
                "lanes": {"batch": st["lanes"]["batch"], "serial": st["lanes"]["solo"]},
                "serial_reasons": st["solo_reasons"]}

    # --- /stats -------------------------------------------------------------

    def stats(self) -> dict:
        pc = self.prompt_cache.stats() if self.prompt_cache is not None else {
            "enabled": False, "max_bytes": 0, "bytes": 0, "entries": 0, "hits": 0, "misses": 0,
            "evictions": 0, "tokens_reused": 0}
        prompt_cache = {"entries": pc["entries"], "bytes": pc["bytes"],
                        "max_bytes": pc["max_bytes"], "hits": pc["hits"], "misses": pc["misses"],
                        "enabled": pc["enabled"], "evictions": pc["evictions"],
                        "tokens_reused": pc["tokens_reused"]}
        dc = self.engine.disk_cache
        prompt_cache["disk"] = dc.stats() if dc is not None else {"enabled": False}
        adm = self.admission
        g = self.gateway.stats()
        return {
            "server": {"owner": self.config.owner, "model": self.model_id,
                       "started_at": self.started_at,
                       "model_type": self.model_type},
            "prompt_cache": prompt_cache,
            "response_store": self.store.stats(),
            "kv_quant": self.kv_describe(),
            "admission": {"max_safe_context": self.ceiling,
                          "memory_budget_bytes": self.config.memory_budget_bytes,
                          "usable_bytes": adm.budget_bytes, "weights_bytes": adm.weights},
            "batch": self.batch_stats(),
            "queue": g,
            "adapters": {"mounted": list(self.adapters.mounted),
                         "default": list(self.default_adapters)},
            "levers": self._levers_stats(),
            # --deterministic: batch-invariant logits (docs/deterministic.md)
            "deterministic": self.engine.deterministic,
            # the fast runner's shapes built before serving (--warm-up)
            "warm_up": (None if self.warmed is None else
                        {**{k: list(v) if isinstance(v, tuple) else round(v, 3) if k == "seconds"
                            else v for k, v in asdict(self.warmed).items()},
                         "remembered_tokens": self.remembered}),
            # speculation (--prompt-lookup, --draft-model): drafted, accepted, acceptance,
            # forwards; summed, per source and per recent request
            "speculation": {**self.engine.stats()["speculation"],
                            "draft_model": self.config.draft_model},
        }

    def _levers_stats(self) -> dict:
        from engine import describe
        out = describe(self.config.levers, self.model)
        # which runner decodes each lane: with a fast lever, the fast runner for both (the
        # batch's rows, and requests that run alone), but quantized KV stays on L1
        fast = bool(out.get("fast_decode")) and not self.engine.policy.active
        batch = "off" if not self.engine.batching else (
            "fast" if self.engine.fast_step is not None else "l1")
        out["lanes"] = {"solo": "fast" if fast else "l1", "batch": batch}
        return out


def default_model_dir() -> str:
    from engine import default_model_dir as _d
    return _d()


def build_state(config: ServerConfig, gateway: Optional[Gateway] = None,
                model=None, tokenizer=None, wrap_model=None) -> ServerState:
    """Load the model on the worker thread and assemble the state.

    `model`/`tokenizer` may be given (already loaded); then `config.model` is
    only used as the model directory for its config.json. Arrays built lazily
    on one thread cannot be evaluated on another (MLX streams are per thread),
    so loading on the worker is the safe default. `wrap_model(model, tok)`
    (tests) may wrap the loaded model."""
    import dataclasses

    import engine
    from engine import resolve_model_path

    gateway = gateway or Gateway()
    model_dir = config.model or default_model_dir()
    if not Path(model_dir).exists():   # a Hugging Face repo id: its snapshot directory
        if not config.model_id:
            config = dataclasses.replace(config, model_id=model_dir)
        model_dir = str(resolve_model_path(model_dir))

    def load():
        if model is not None:
            m, t = model, tokenizer
        else:
            m, t = engine.load(model_dir, tensor_parallel=config.tensor_parallel)
        if config.chat_template is not None:
            t.set_chat_template(config.chat_template)
        if wrap_model is not None:
            m = wrap_model(m, t)
        if config.prompt_lookup and not config.deterministic:
            from engine import lookup_unsupported
            if lookup_unsupported(m):
                raise ValueError(f"--prompt-lookup: {lookup_unsupported(m)}")
        draft = None
        if config.draft_model:          # (same vocabulary, else DraftModelError: a ValueError)
            from engine import load_draft
            draft = load_draft(config.draft_model, m, t)
        state = ServerState(config, gateway, m, t, model_dir, draft_model=draft)
        if config.warm_up:              # (on this thread: the one that steps the engine)
            from engine import warm_up
            long_prompt, rehearse = long_warm_up(config, state.engine)
            # (not the L1 burst under tensor parallelism: its followers step with the leader)
            state.warmed = warm_up(state.engine, draft_tokens=config.num_draft_tokens,
                                   l1=False if config.tensor_parallel else None,
                                   lookup=config.prompt_lookup, long_prompt=long_prompt,
                                   rehearse=rehearse)
            warm_template(t)
            if rehearse:     # (the stored prefix's text: that turn tokenizes only its new part)
                state.remembered = remember(t, state.engine.disk_cache.longest_ids())
        if config.adapter:
            mounted = state.adapters.mount(Path(config.adapter).name or "default",
                                           config.adapter)
            state.default_adapters = (mounted.id,)
            state.refresh_admission()
        return state

    return gateway.call_sync(load)


def long_warm_up(config: ServerConfig, engine) -> tuple:
    """(the warm-up's long prompt, the files it reads once): `--warm-up-tokens` (0: neither),
    else the longest prefix the disk prompt cache holds and its files (what the first turn
    after a restart restores), else none."""
    disk = engine.disk_cache
    tokens, paths = disk.longest_chain() if disk is not None else (0, [])
    if config.warm_up_tokens is not None:
        return config.warm_up_tokens, paths if config.warm_up_tokens else []
    return tokens, paths


def remember(tokenizer, ids: list) -> int:
    """`Tokenizer.remember_prompt(ids)`; 0 (and a log line) for ids it cannot decode: an
    optimisation of the first turn, never a failed start."""
    try:
        return tokenizer.remember_prompt(ids)
    except (ValueError, TypeError, OverflowError) as e:
        log.warning("warm-up: the stored prefix's text could not be encoded (%s)", e)
        return 0


WARM_TOOL = {"type": "function", "function": {"name": "f", "description": ".", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}


def warm_template(tokenizer) -> None:
    """What a fresh process's first request would pay once, paid here: the chat template's
    compile (rendered once, with a tool: ~30 ms on a 2-core CPU for a Qwen-style template),
    the JSON Schema check of a tool's parameters (importing jsonschema and its meta-schema:
    ~40 ms) and the modules anyio loads on a first streamed answer (~10 ms). A template that
    cannot take this conversation is left to the requests."""
    import anyio

    from engine import PromptError, check_json_schema, encode_prompt
    anyio.create_memory_object_stream, anyio.connect_tcp   # (anyio imports these lazily)
    check_json_schema(WARM_TOOL["function"]["parameters"])
    if getattr(tokenizer, "chat_template", None) is None:
        return
    try:
        encode_prompt(tokenizer, [{"role": "system", "content": "."},
                                  {"role": "user", "content": "."}], tools=[WARM_TOOL])
    except PromptError:
        pass

