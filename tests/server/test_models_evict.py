"""Several models under one memory budget: load once, LRU eviction (never of a busy or
pinned model), 503 + Retry-After when nothing fits, idle TTL, a broken model folder, a
huge --models-dir (issue #40, hostile cases)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

from pool_helpers import GatedModel, chat_body, chat_ids, start_pool, stream_ids

BIG = 1_000_000_000          # each model's own admission budget (--memory-budget)


def weights_est(model_dir) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def kv256(model_dir) -> int:
    """The KV bytes one request of at most 256 tokens reserves (the cache's first step)."""
    import engine
    m, _ = engine.load(model_dir)
    return engine.Admission.for_model(m, BIG).kv_bytes(1)


def copies(model_dir, names):
    return [f"{n}={model_dir}" for n in names]


def test_eviction_while_another_model_streams(qwen_dir):
    """b streams (held mid-generation); c needs room: b is the least recently used but
    busy, so a (idle) is unloaded, never b; b's stream ends with the tokens it gives alone."""
    w, kv = weights_est(qwen_dir), kv256(qwen_dir)
    s = start_pool(copies(qwen_dir, "abc"), 2 * w + 2 * kv + 1000, wrap_model=GatedModel,
                   memory_budget_bytes=BIG, prompt_cache_bytes=0, batch=2)
    try:
        body = chat_body("b", "a story about eviction", 40)
        assert httpx.post(s.url + "/v1/chat/completions",
                          json=chat_body("a", "hi", 2)).status_code == 200
        ref = chat_ids(s.url, body)          # b alone (also loads it)
        assert s.pool.slots["a"].state is not None and s.pool.slots["b"].state is not None
        gated = s.pool.slots["b"].state.model
        out = {}

        def on_first():
            gated.hold()     # b's next forward waits: b is streaming, mid-generation

        t = threading.Thread(target=lambda: out.setdefault("b", stream_ids(s.url, body,
                                                                            on_first)))
        t.start()
        assert gated.wait_held(30)
        assert s.pool.slots["b"].kv_bytes() == kv          # its KV is reserved
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("a", "hi", 2))
        assert r.status_code == 200          # a was used after b: b is the LRU, but busy
        assert s.pool.slots["b"].last_used < s.pool.slots["a"].last_used
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("c", "hi", 3))
        assert r.status_code == 200, r.text
        assert s.pool.slots["a"].state is None             # a made room
        assert s.pool.slots["b"].state is not None         # b (streaming) did not
        # everything is busy now but a: c is idle, so a comes back in c's place
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("a", "hi", 3))
        assert r.status_code == 200 and s.pool.slots["c"].state is None
        gated.release()
        t.join(60)
        assert out["b"] == ref
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["evictions"]["lru"] == 2 and st["loads"] == 4
        assert st["used_bytes"] <= st["memory_budget_bytes"]
        assert st["kv_reserved_bytes"] == 0                  # b's reservation ended with it
        text = httpx.get(s.url + "/metrics").text
        assert 'engine_models_evictions_total{reason="lru"} 2.0' in text
    finally:
        for slot in s.pool.slots.values():
            if slot.state is not None:
                slot.state.model.release()
        s.stop()


def test_nothing_fits_is_a_503_with_retry_after(qwen_dir):
    """a is pinned; b's weights do not fit beside it: 503 in each protocol's shape, the
    server keeps serving a; a request whose KV does not fit is a 503 too."""
    w, kv = weights_est(qwen_dir), kv256(qwen_dir)
    s = start_pool(copies(qwen_dir, "ab"), w + kv + 1000, pins=("a",),
                   memory_budget_bytes=BIG, prompt_cache_bytes=0)
    try:
        assert s.pool.slots["a"].state is not None            # pinned: loaded at start
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("b", "hi", 2))
        assert r.status_code == 503 and r.headers["retry-after"]
        err = r.json()["error"]
        assert err["type"] == "overloaded_error" and err["code"] == "models_memory_full"
        r = httpx.post(s.url + "/v1/messages", json=chat_body("b", "hi", 2))
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "overloaded_error"
        # a's KV: 256 tokens fit, 512 do not (it fits a's own admission: 503, not 400)
        assert httpx.post(s.url + "/v1/chat/completions",
                          json=chat_body("a", "hi", 100)).status_code == 200
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("a", "hi", 400))
        assert r.status_code == 503 and r.json()["error"]["code"] == "models_memory_full"
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["resident"] == ["a"] and st["rejected"] == 3 and st["evictions"]["lru"] == 0
        assert st["pinned"] == ["a"]
    finally:
        s.stop()


def test_uncapped_request_gets_the_kv_that_is_free(qwen_dir):
    """Without max_tokens a request runs to the context left; under a shared budget its
    max_tokens is cut to what the free KV holds (never a 503 while one token fits)."""
    w, kv = weights_est(qwen_dir), kv256(qwen_dir)
    s = start_pool(copies(qwen_dir, "a"), w + 2 * kv + 1000, memory_budget_bytes=BIG,
                   prompt_cache_bytes=0)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("a", "hi", 1))
        assert r.status_code == 200
        slot = s.pool.slots["a"]
        lease = asyncio.run(s.pool.acquire("a"))
        try:
            n = asyncio.run(lease.reserve(slot.state, 10, 4000, True))
            assert 1 <= n <= 512 - 10 and lease.kv_bytes <= 2 * kv      # cut to fit
            assert s.pool.used_bytes() <= s.pool.budget_bytes
            with pytest.raises(Exception) as e:                           # capped: refused
                asyncio.run(lease.reserve(slot.state, 10, 4000, False))
            assert getattr(e.value, "status", None) == 503
        finally:
            lease.release()
    finally:
        s.stop()


def test_racing_requests_load_a_model_once(qwen_dir, llama_dir):
    s = start_pool([f"q={qwen_dir}", f"l={llama_dir}"], BIG, batch=4)
    try:
        codes, barrier = [], threading.Barrier(6)

        def go():
            barrier.wait(30)
            codes.append(httpx.post(s.url + "/v1/chat/completions",
                                    json=chat_body("l", "hi", 2), timeout=60).status_code)
        threads = [threading.Thread(target=go) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert codes == [200] * 6
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["loads"] == 1 and st["per_model"]["l"]["loads"] == 1
        assert st["resident"] == ["l"] and st["loading"] == []
    finally:
        s.stop()


def test_idle_ttl_unloads_but_not_a_pinned_model(qwen_dir):
    s = start_pool(copies(qwen_dir, "ab"), BIG, pins=("a",), idle_ttl_s=0.3)
    try:
        assert httpx.post(s.url + "/v1/chat/completions",
                          json=chat_body("b", "hi", 2)).status_code == 200
        assert s.pool.slots["b"].state is not None
        deadline = time.monotonic() + 10
        while s.pool.slots["b"].state is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["resident"] == ["a"] and st["evictions"]["idle_ttl"] == 1
        assert httpx.post(s.url + "/v1/chat/completions",       # b loads again on use
                          json=chat_body("b", "hi", 2)).status_code == 200
        assert httpx.get(s.url + "/stats").json()["models"]["per_model"]["b"]["loads"] == 2
    finally:
        s.stop()


def _fake_dir(root, name, qwen_dir, weights=True):
    d = root / name
    d.mkdir()
    for f in qwen_dir.iterdir():
        if f.suffix == ".safetensors" and not weights:
            continue
        os.symlink(f, d / f.name)
    return d


def test_huge_models_dir(tmp_path, qwen_dir):
    root = tmp_path / "models"
    root.mkdir()
    n = 400
    for i in range(n):
        _fake_dir(root, f"m{i:04d}", qwen_dir)
    _fake_dir(root, "no-weights", qwen_dir, weights=False)     # skipped
    (root / "a-file.txt").write_text("not a model")            # skipped
    t0 = time.monotonic()
    s = start_pool([], BIG, models_dir=str(root))
    try:
        assert time.monotonic() - t0 < 30
        data = httpx.get(s.url + "/v1/models").json()["data"]
        assert len(data) == n and all(c["context_length"] == 4096 for c in data)
        assert [c["id"] for c in data[:2]] == ["m0000", "m0001"]
        assert not any(c["loaded"] for c in data)
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("m0321", "hi", 2))
        assert r.status_code == 200 and r.json()["model"] == "m0321"
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("no-weights", "hi", 2))
        assert r.status_code == 404
        st = httpx.get(s.url + "/stats").json()
        assert st["models"]["configured"] == n and list(st["models"]["per_model"]) == ["m0321"]
    finally:
        s.stop()


def test_a_model_that_cannot_load_is_a_503_and_the_others_serve(tmp_path, qwen_dir):
    root = tmp_path / "models"
    root.mkdir()
    _fake_dir(root, "good", qwen_dir)
    bad = root / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen3", "max_position_embeddings": 8}')
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)         # not safetensors
    s = start_pool([], BIG, models_dir=str(root))
    try:
        for _ in range(2):       # (and again: a failed load is retried, fails the same)
            r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("bad", "hi", 2))
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "model_load_failed" and str(root) not in err["message"]
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("good", "hi", 2))
        assert r.status_code == 200
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["load_failures"] == 2 and st["resident"] == ["good"]
        assert st["used_bytes"] == st["per_model"]["good"]["weights_bytes"] + \
            st["per_model"]["good"]["prompt_cache_bytes"]
    finally:
        s.stop()
