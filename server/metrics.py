"""`GET /metrics`: Prometheus exposition (through `prometheus_client`).

Two sources, neither inside the request handlers:

- `MetricsMiddleware`, an ASGI middleware around the whole app, sees every
  request and its response messages: request counts by protocol and status,
  end-to-end latency, and for streamed (SSE) responses the time to the first
  chunk of generated output (an opening frame written before generation starts,
  such as OpenAI's role delta, does not count) and the gaps between later chunks
  (inter-token latency; with `--stream-interval-ms` above 0 the server
  coalesces tokens, so a gap can span several tokens). Prompt and generated
  token counts come from the `usage` every protocol reports in its response.
- `ServerCollector` reads the live server state when scraped: queue depth,
  running generations, batch rows (handed over, decoding now, peak), the
  generations completed / cancelled / failed (the gateway's counters, as in
  /stats), prompt-cache hits/misses/bytes/entries, and MLX's active and peak
  memory.

Each app has its own `CollectorRegistry`, so several servers in one process
(tests) do not share counters.
"""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from .gateway import RECEIVED_AT
from .schemas.common import READ_ERRORS, responses_for

PROTOCOLS = (
    ("/v1/chat/completions", "openai_chat"), ("/chat/completions", "openai_chat"),
    ("/v1/completions", "openai_completions"), ("/v1/messages", "anthropic"),
    ("/v1/responses", "responses"),
)
# A stream's opening frame, written before generation starts (not generated output):
# OpenAI chat's role delta, Anthropic's message_start, Responses' response.created.
OPENING_FRAMES = (b'"delta":{"role":"assistant","content":""}', b"event: message_start",
                  b"event: response.created")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def protocol_of(path: str) -> str:
    for prefix, name in PROTOCOLS:
        if path == prefix or path.startswith(prefix + "/"):
            return name
    return "other"


class Metrics:
    """The per-app registry and the request-side metrics."""

    def __init__(self, state=None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("engine_requests", "HTTP requests by protocol and status",
                                ["protocol", "status"], registry=r)
        self.latency = Histogram("engine_request_duration_seconds",
                                 "end-to-end request latency (to the last byte)", ["protocol"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("engine_time_to_first_token_seconds",
                              "streamed requests: time to the first generated chunk",
                              ["protocol"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("engine_inter_token_latency_seconds",
                             "streamed requests: time between generated chunks", ["protocol"],
                             buckets=GAP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("engine_prompt_tokens", "prompt tokens (from usage)",
                                     ["protocol"], registry=r)
        self.generation_tokens = Counter("engine_generation_tokens",
                                         "generated tokens (from usage)", ["protocol"],
                                         registry=r)
        if state is not None:      # (several models: the pool's collector, by model)
            collector = getattr(state, "metrics_collector", None)
            r.register(collector() if collector is not None else ServerCollector(state))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _find_usage(obj):
    """The first `usage` dict anywhere in a decoded JSON value."""
    if isinstance(obj, dict):
        u = obj.get("usage")
        if isinstance(u, dict):
            return u
        for v in obj.values():
            found = _find_usage(v) if isinstance(v, (dict, list)) else None
            if found is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find_usage(v)
            if found is not None:
                return found
    return None


class _Usage:
    """Token counts a response reports (OpenAI prompt/completion_tokens, Anthropic and
    Responses input/output_tokens; streams spread them over several events)."""

    def __init__(self):
        self.prompt = 0
        self.generated = 0

    def take(self, obj) -> None:
        u = _find_usage(obj)
        if not u:
            return
        p = u.get("prompt_tokens", u.get("input_tokens"))
        g = u.get("completion_tokens", u.get("output_tokens"))
        if isinstance(p, int):
            self.prompt = max(self.prompt, p)
        if isinstance(g, int):
            self.generated = max(self.generated, g)

    def take_sse(self, chunk: bytes) -> None:
        if b'"usage"' not in chunk:
            return
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    self.take(json.loads(line[6:]))
                except ValueError:
                    pass


class MetricsMiddleware:
    """Times and counts every HTTP request; see the module docstring."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.m = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        proto = protocol_of(scope["path"])
        t0 = time.perf_counter()
        RECEIVED_AT.set(t0)
        status = [500]
        started = [False]
        gone = [False]                  # the client left (its body or the answer unfinished)
        kind = {"sse": False, "json": False}
        body_parts: list = []
        chunks = [0]
        last = [t0]
        usage = _Usage()

        async def timed_send(message):
            t = message["type"]
            if t == "http.response.start":
                status[0], started[0] = message["status"], True
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                kind["sse"] = ctype.startswith(b"text/event-stream")
                kind["json"] = ctype.startswith(b"application/json") and proto != "other"
            elif t == "http.response.body":
                body = message.get("body", b"")
                now = time.perf_counter()
                if kind["sse"] and body:
                    opening = chunks[0] == 0 and any(f in body for f in OPENING_FRAMES)
                    if not opening:
                        chunks[0] += 1
                        if chunks[0] == 1:
                            self.m.ttft.labels(proto).observe(now - t0)
                        else:
                            self.m.itl.labels(proto).observe(now - last[0])
                        last[0] = now
                    usage.take_sse(body)
                elif kind["json"] and body:
                    body_parts.append(body)
            await send(message)

        async def noted_receive():
            message = await receive()
            if message["type"] == "http.disconnect":
                gone[0] = True
            return message

        try:
            await self.app(scope, noted_receive, timed_send)
        finally:
            if gone[0] and not started[0]:
                status[0] = 499         # client closed the request before any answer (nginx's 499)
            self.m.requests.labels(proto, str(status[0])).inc()
            self.m.latency.labels(proto).observe(time.perf_counter() - t0)
            if body_parts and status[0] < 400:
                try:
                    usage.take(json.loads(b"".join(body_parts)))
                except ValueError:
                    pass
            if usage.prompt:
                self.m.prompt_tokens.labels(proto).inc(usage.prompt)
            if usage.generated:
                self.m.generation_tokens.labels(proto).inc(usage.generated)


class ServerCollector:
    """Gauges and counters read from the server state at scrape time."""

    def __init__(self, state):
        self.state = state

    def describe(self):
        # Nothing to check at registration: the state is read at scrape time only.
        return []

    def collect(self):
        st = self.state
        g = st.gateway.stats()
        yield GaugeMetricFamily("engine_queue_depth", "generations waiting for the model",
                                value=g["queued"])
        yield GaugeMetricFamily("engine_active_generations", "generations running now",
                                value=g["active"])
        b = st.batch_stats()     # the Engine's counters, through the server state
        rows = b["active_rows"]
        size = b["configured"] if b["batched"] else 1   # unbatched (--batch 1, KV quant): 1
        yield GaugeMetricFamily("engine_batch_rows", "batch rows in use", value=rows)
        yield GaugeMetricFamily("engine_batch_rows_max", "batch rows configured (--batch)",
                                value=size)
        yield GaugeMetricFamily("engine_batch_rows_decoding", "rows decoding now",
                                value=b["rows_now"])
        yield GaugeMetricFamily("engine_batch_rows_peak",
                                "most rows that ran one decode step together",
                                value=b["peak_rows"])
        for name, help_, key in GATEWAY_COUNTERS:
            yield CounterMetricFamily(name, help_, value=g[key])
        if st.prompt_cache is not None:
            pc = st.prompt_cache.stats()
            for kind, name, help_, key in PROMPT_CACHE:
                yield kind(name, help_, value=pc[key])
        eng = getattr(st, "engine", None)
        spec = eng.stats()["speculation"] if eng is not None else None
        if spec is not None:     # speculation, by source: lookup (--prompt-lookup), draft
            for name, help_, key in SPECULATION:
                fam = CounterMetricFamily(name, help_, labels=["source"])
                for source in SPEC_SOURCES:
                    fam.add_metric([source], spec[source][key])
                yield fam
        disk = getattr(eng, "disk_cache", None)
        if disk is not None:
            dc = disk.stats()
            for kind, name, help_, key in DISK_CACHE:
                yield kind(name, help_, value=dc[key])
        import mlx.core as mx
        yield GaugeMetricFamily("engine_memory_active_bytes", "MLX active memory",
                                value=mx.get_active_memory())
        yield GaugeMetricFamily("engine_memory_peak_bytes", "MLX peak memory since start",
                                value=mx.get_peak_memory())


SPECULATION = (
    ("engine_spec_drafted_tokens", "draft tokens verified (source: lookup = prompt lookup, "
     "draft = the draft model)", "drafted"),
    ("engine_spec_accepted_tokens", "draft tokens accepted", "accepted"),
    ("engine_spec_verify_forwards", "verify forwards of speculating requests", "forwards"),
)
SPEC_SOURCES = ("lookup", "draft")

GATEWAY_COUNTERS = (
    ("engine_generations_completed", "generations finished", "completed"),
    ("engine_generations_cancelled", "generations cancelled", "cancelled"),
    ("engine_generations_failed", "generations failed", "failed"),
)
PROMPT_CACHE = (
    (CounterMetricFamily, "engine_prompt_cache_hits", "prompt-cache hits", "hits"),
    (CounterMetricFamily, "engine_prompt_cache_misses", "prompt-cache misses", "misses"),
    (CounterMetricFamily, "engine_prompt_cache_evictions", "prompt-cache evictions",
     "evictions"),
    (GaugeMetricFamily, "engine_prompt_cache_bytes", "bytes held by the prompt cache", "bytes"),
    (GaugeMetricFamily, "engine_prompt_cache_max_bytes", "prompt-cache cap", "max_bytes"),
    (GaugeMetricFamily, "engine_prompt_cache_entries", "prompt-cache entries", "entries"),
)
DISK_CACHE = (
    (CounterMetricFamily, "engine_prompt_cache_disk_hits", "prefixes read from disk", "hits"),
    (CounterMetricFamily, "engine_prompt_cache_disk_written_bytes",
     "bytes of prompt-cache files written", "bytes_written"),
    (GaugeMetricFamily, "engine_prompt_cache_disk_bytes", "bytes of prompt-cache files held",
     "bytes"),
    (GaugeMetricFamily, "engine_prompt_cache_disk_files", "prompt-cache files held", "files"),
)


async def metrics_route(request: Request):
    m: Metrics = request.app.state.metrics
    return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)


def install(app, state) -> Metrics:
    """Register GET /metrics and the middleware on an app (call after other middleware,
    so it is the outermost one and also counts rejected requests)."""
    m = Metrics(state)
    app.state.metrics = m
    app.router.add_api_route("/metrics", metrics_route, methods=["GET"], tags=["admin"],
                             response_class=PlainTextResponse,
                             responses=responses_for(None, READ_ERRORS),
                             summary="Prometheus metrics (text exposition format)")
    app.add_middleware(MetricsMiddleware, metrics=m)
    return m
