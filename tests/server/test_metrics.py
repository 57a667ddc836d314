"""GET /metrics: Prometheus text, scraped after real traffic and parsed with
prometheus_client's own parser. The shared server has served other tests'
traffic, so every count is checked as a difference across our requests."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from srv_helpers import sse_events, start_server, stop_server


def scrape(url: str, **headers) -> dict:
    r = httpx.get(url + "/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_traffic_by_protocol_status_and_tokens(srv):
    before = scrape(srv.url)
    msgs = [{"role": "user", "content": "hello there"}]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        a = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5,
                                                 "temperature": 0}).json()
        s = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6,
                                                 "temperature": 0, "stream": True})
        m = c.post("/v1/messages", json={"model": "x", "messages": msgs, "max_tokens": 4}).json()
        c.post("/v1/messages", json={"model": "x", "messages": msgs, "max_tokens": 4,
                                     "stream": True})
        c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True})
        c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 4,
                                      "stream": True})
        bad = c.post("/v1/chat/completions", json={"messages": "not a list"})
    assert bad.status_code == 400
    last = [d for _, d in sse_events(s.text) if d != "[DONE]" and d.get("usage")][-1]["usage"]
    after = scrape(srv.url)

    def delta(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)

    assert delta("engine_requests_total", protocol="openai_chat", status="200") == 2
    assert delta("engine_requests_total", protocol="openai_chat", status="400") == 1
    assert delta("engine_requests_total", protocol="anthropic", status="200") == 2
    for proto in ("anthropic", "openai_completions", "responses"):
        assert delta("engine_time_to_first_token_seconds_count", protocol=proto) == 1, proto
        assert delta("engine_generation_tokens_total", protocol=proto) > 0, proto
    assert delta("engine_request_duration_seconds_count", protocol="openai_chat") == 3
    assert delta("engine_time_to_first_token_seconds_count", protocol="openai_chat") == 1
    assert delta("engine_inter_token_latency_seconds_count", protocol="openai_chat") >= 1
    assert delta("engine_prompt_tokens_total", protocol="openai_chat") == (
        a["usage"]["prompt_tokens"] + last["prompt_tokens"])
    assert delta("engine_generation_tokens_total", protocol="openai_chat") == (
        a["usage"]["completion_tokens"] + last["completion_tokens"])
    assert delta("engine_prompt_tokens_total", protocol="anthropic") >= m["usage"]["input_tokens"]
    # the same prompt twice: the prompt cache was asked at least three times
    assert (delta("engine_prompt_cache_hits_total") + delta("engine_prompt_cache_misses_total")
            >= 3)
    assert delta("engine_generations_completed_total") == 6
    for name in ("engine_queue_depth", "engine_batch_rows", "engine_prompt_cache_bytes",
                 "engine_prompt_cache_entries"):
        assert (name, ()) in after, name
    assert val(after, "engine_batch_rows_max") == 1
    assert val(after, "engine_memory_active_bytes") > 0
    assert val(after, "engine_memory_peak_bytes") >= val(after, "engine_memory_active_bytes")


@pytest.fixture(scope="module")
def keyed(qwen_dir):
    s = start_server(qwen_dir, api_key="sekret", prompt_cache_bytes=0, batch=2)
    yield s
    stop_server(s)


def test_metrics_sit_behind_the_api_key_and_count_rejections(keyed):
    r = httpx.get(keyed.url + "/metrics", timeout=30)
    assert r.status_code == 401
    m = scrape(keyed.url, authorization="Bearer sekret")
    assert val(m, "engine_requests_total", protocol="other", status="401") == 1
    assert val(m, "engine_batch_rows_max") == 2
    assert ("engine_prompt_cache_hits_total", ()) not in m   # cache disabled: not reported


def test_stream_timing_skips_the_opening_frame_and_reads_usage():
    """The middleware on a scripted ASGI stream: an opening frame, then 3 generated chunks
    -> 1 TTFT + 2 gaps; token counts from the last chunk's usage."""
    import asyncio

    from server.metrics import Metrics, MetricsMiddleware

    opening = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    frames = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'] * 2 + [
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
        b"data: [DONE]\n\n"]

    def app_with(first):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for body in ([first] if first else []) + frames:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return app

    async def drive(mw):
        async def send(_):
            pass
        await mw({"type": "http", "path": "/v1/chat/completions", "method": "POST"},
                 None, send)

    for first in (opening, None):
        m = Metrics()
        asyncio.run(drive(MetricsMiddleware(app_with(first), m)))
        got = {(s.name, s.labels.get("protocol")): s.value
               for fam in m.registry.collect() for s in fam.samples}
        assert got[("engine_time_to_first_token_seconds_count", "openai_chat")] == 1
        assert got[("engine_inter_token_latency_seconds_count", "openai_chat")] == 2
        assert got[("engine_prompt_tokens_total", "openai_chat")] == 7
        assert got[("engine_generation_tokens_total", "openai_chat")] == 3


def test_client_gone_before_its_body_is_499_not_500():
    """A client that leaves before its body arrives is counted as 499 (client closed), not as a
    server error; one that got an answer keeps that answer's status."""
    import asyncio

    from server.metrics import Metrics, MetricsMiddleware

    async def reads_body(scope, receive, send):      # like BodyGuard: gives up on a disconnect
        while (await receive())["type"] != "http.disconnect":
            pass

    async def answers(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})
        await receive()

    async def drive(mw):
        msgs = iter([{"type": "http.request", "body": b"{", "more_body": True},
                     {"type": "http.disconnect"}])

        async def receive():
            return next(msgs)

        async def send(_):
            pass
        await mw({"type": "http", "path": "/v1/messages", "method": "POST"}, receive, send)

    for app, want in ((reads_body, "499"), (answers, "200")):
        m = Metrics()
        asyncio.run(drive(MetricsMiddleware(app, m)))
        got = {s.labels.get("status"): s.value for fam in m.registry.collect()
               for s in fam.samples if s.name == "engine_requests_total"}
        assert got == {want: 1.0}, (app.__name__, got)


@pytest.mark.parametrize("batched,configured,rows_max", [(True, 4, 4), (False, 4, 1)])
def test_collector_reads_the_engine_counters_through_the_state(batched, configured, rows_max):
    """Batch gauges come from the state's `batch_stats()` (the Engine's `stats()`): the batched
    lane reports its rows and `--batch`; one-at-a-time (--batch 1, KV quant) reports 1."""
    from server.metrics import ServerCollector

    class Gateway:
        def stats(self):
            return {"queued": 2, "active": 3, "completed": 5, "cancelled": 1, "failed": 0}

    class State:
        gateway, prompt_cache = Gateway(), None

        def batch_stats(self):
            return {"configured": configured, "batched": batched, "active_rows": 3,
                    "rows_now": 2, "peak_rows": 4}

    got = {fam.name: fam.samples[0].value for fam in ServerCollector(State()).collect()}
    assert got["engine_queue_depth"] == 2 and got["engine_active_generations"] == 3
    assert got["engine_batch_rows"] == 3 and got["engine_batch_rows_max"] == rows_max
    assert got["engine_batch_rows_decoding"] == 2 and got["engine_batch_rows_peak"] == 4
    assert got["engine_generations_completed"] == 5
