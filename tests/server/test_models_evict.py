"""Several models under one memory budget: load once, LRU eviction (never of a busy or
pinned model), 503 + Retry-After when nothing fits, idle TTL, a broken model folder, a
huge --models-dir (issue #40, hostile cases)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from pool_helpers import GatedModel, chat_body, start_pool
from srv_helpers import NO_EOS

BIG = 1_000_000_000          # each model's own admission budget (--memory-budget)
P = 10                       # prompt tokens of the requests below (token ids: exact)


def weights_est(model_dir) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def costs(model_dir):
    """(what a request of n tokens reserves, the runtime slack counted once), as the pool
    computes them."""
    import engine
    from server.models_pool import request_bytes
    m, _ = engine.load(model_dir)
    adm = engine.Admission.for_model(m, BIG)
    return (lambda n: request_bytes(adm, n)), adm.FIXED_SLACK[adm.backend]


def copies(model_dir, names):
    return [f"{n}={model_dir}" for n in names]


def completion(url, model, max_tokens, **kw):
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": list(range(20, 20 + P)), "max_tokens": max_tokens,
        "temperature": 0, **kw})


def stream_text(url, model, max_tokens, on_first=None) -> str:
    out = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": list(range(20, 20 + P)), "max_tokens": max_tokens,
            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    out.append(c["text"])
                    if c["text"] and on_first is not None:
                        on_first()
                        on_first = None
    return "".join(out)


def test_eviction_while_another_model_streams(qwen_dir):
    """b streams (held mid-generation); c needs room: b is the least recently used but
    busy, so a (idle) is unloaded, never b; b's stream ends with the text it gives alone."""
    w, (cost, slack) = weights_est(qwen_dir), costs(qwen_dir)
    budget = 2 * w + cost(P + 40) + cost(P + 2) + slack + 500
    s = start_pool(copies(qwen_dir, "abc"), budget, wrap_model=GatedModel,
                   memory_budget_bytes=BIG, prompt_cache_bytes=0, batch=2)
    try:
        r = completion(s.url, "b", 40)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == P
        ref = r.json()["choices"][0]["text"]                 # b alone
        assert completion(s.url, "a", 2).status_code == 200
        assert s.pool.slots["a"].state is not None and s.pool.slots["b"].state is not None
        gated = s.pool.slots["b"].state.model
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("b", stream_text(
            s.url, "b", 40, on_first=gated.hold)))    # b's next forward waits: mid-stream
        t.start()
        assert gated.wait_held(30)
        assert s.pool.slots["b"].reserved_bytes() == cost(P + 40)    # its memory is reserved
        assert completion(s.url, "a", 2).status_code == 200
        # a was used after b: b is the least recently used, but busy
        assert s.pool.slots["b"].last_used < s.pool.slots["a"].last_used
        r = completion(s.url, "c", 2)
        assert r.status_code == 200, r.text
        assert s.pool.slots["a"].state is None             # a made room
        assert s.pool.slots["b"].state is not None         # b (streaming) did not
        r = completion(s.url, "a", 2)                      # now c is idle: a comes back
        assert r.status_code == 200 and s.pool.slots["c"].state is None
        gated.release()
        t.join(60)
        assert out["b"] == ref
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["evictions"]["lru"] == 2 and st["loads"] == 4
        assert st["used_bytes"] <= st["memory_budget_bytes"]
        assert st["reserved_bytes"] == 0                     # b's reservation ended with it
        assert st["runtime_bytes"] == slack
        text = httpx.get(s.url + "/metrics").text
        assert 'engine_models_evictions_total{reason="lru"} 2.0' in text
    finally:
        for slot in s.pool.slots.values():
            if slot.state is not None:
                slot.state.model.release()
        s.stop()


def test_nothing_fits_is_a_503_with_retry_after(qwen_dir):
    """a is pinned; b's weights do not fit beside it: 503 in each protocol's shape, the
    server keeps serving a; a request whose memory does not fit is a 503 too, and
    nothing was evicted for a request refused anyway."""
    w, (cost, slack) = weights_est(qwen_dir), costs(qwen_dir)
    s = start_pool(copies(qwen_dir, "ab"), w + cost(P + 30) + slack + 500, pins=("a",),
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
        # a: 30 new tokens fit, 200 do not (within a's own admission: a 503, not a 400)
        assert cost(P + 30) < weights_est(qwen_dir) < cost(P + 200)
        assert completion(s.url, "a", 30).status_code == 200
        r = completion(s.url, "a", 200)
        assert r.status_code == 503 and r.json()["error"]["code"] == "models_memory_full"
        assert r.headers["retry-after"]
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["resident"] == ["a"] and st["rejected"] == 3 and st["evictions"]["lru"] == 0
        assert st["pinned"] == ["a"]
    finally:
        s.stop()


def test_uncapped_request_gets_the_memory_that_is_free(qwen_dir):
    """Without max_tokens a request runs to the context left; under a shared budget its
    max_tokens is cut to what the free memory holds (never a 503 while one token fits)."""
    w, (cost, slack) = weights_est(qwen_dir), costs(qwen_dir)
    s = start_pool(copies(qwen_dir, "a"), w + cost(300) + slack + 500,
                   memory_budget_bytes=BIG, prompt_cache_bytes=0)
    try:
        assert completion(s.url, "a", 1).status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={
            "model": "a", "prompt": list(range(20, 20 + P)), "logit_bias": NO_EOS})
        assert r.status_code == 200
        n = r.json()["usage"]["completion_tokens"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        free = s.pool.budget_bytes - s.pool.slots["a"].weights_bytes - slack
        assert cost(P + n) <= free < cost(P + n + 1)           # cut to what was free
        assert 250 < P + n < 350
        assert s.pool.used_bytes() <= s.pool.budget_bytes
        lease = asyncio.run(s.pool.acquire("a"))
        try:
            with pytest.raises(Exception) as e:                     # capped: refused
                asyncio.run(lease.reserve(s.pool.slots["a"].state, P, 4000, False))
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
    junk = _fake_dir(root, "junk-config", qwen_dir)              # skipped: config.json not a model's
    (junk / "config.json").unlink()
    (junk / "config.json").write_text("not json {")
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
        for skipped in ("no-weights", "junk-config"):
            r = httpx.post(s.url + "/v1/chat/completions", json=chat_body(skipped, "hi", 2))
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
        good = st["per_model"]["good"]
        assert st["used_bytes"] == (good["weights_bytes"] + good["prompt_cache_bytes"]
                                    + st["runtime_bytes"])
    finally:
        s.stop()


def test_churn_stays_within_the_budget(qwen_dir, llama_dir):
    """Four clients, four models, room for about two: only 200s and 503s, every 200
    stream complete, the accounting never past the budget, nothing left reserved or
    closing, and the unloaded models' workers gone."""
    import collections
    import random

    _, (cost, slack) = weights_est(qwen_dir), costs(qwen_dir)
    budget = 2 * weights_est(llama_dir) + slack + 4 * cost(60)
    s = start_pool([f"a={qwen_dir}", f"b={qwen_dir}", f"c={llama_dir}", f"d={qwen_dir}"],
                   budget, memory_budget_bytes=BIG, prompt_cache_bytes=0, batch=4)
    codes, used, stop = collections.Counter(), [], time.monotonic() + 4

    errors = []

    def client(seed):
        rnd, c = random.Random(seed), httpx.Client(timeout=60)
        while time.monotonic() < stop:
            body = chat_body(rnd.choice("abcd"), f"x {rnd.random()}", rnd.randint(1, 30))
            try:
                with c.stream("POST", s.url + "/v1/chat/completions",
                              json={**body, "stream": rnd.random() < 0.5}) as r:
                    data = r.read()
                    codes[r.status_code] += 1
                    if r.status_code == 200:
                        assert b'"error"' not in data
                        assert b"[DONE]" in data or b'"finish_reason":"length"' in data
            except BaseException as e:      # (reported below)
                errors.append(e)
                return

    def watch():
        while time.monotonic() < stop:
            used.append(s.pool.used_bytes())
            time.sleep(0.01)
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        threads.append(threading.Thread(target=watch))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert set(codes) <= {200, 503} and codes[200] > 10, codes
        assert max(used) <= budget
        st = httpx.get(s.url + "/stats").json()["models"]
        assert st["evictions"]["lru"] > 0 and st["reserved_bytes"] == 0
        assert s.pool.closing == 0 and not s.pool.closing_bytes
        workers = [t for t in threading.enumerate() if t.name in {f"engine-{m}" for m in "abcd"}]
        assert len(workers) == len(st["resident"])
    finally:
        s.stop()
