"""`--batch 4`: batched rows under concurrent load (engine.Engine behind the server).

Requests sent together (batch lane) return the same text as the same requests
on a server without batching (serial lane): greedy ones, and seeded sampling
ones (each row samples with its own key from its seed): on the stock CPU wheel
full-attention rows are bit-identical in and out of a batch. Also: the lane
picker (a per-request adapter goes to the serial lane), the prompt cache filled
and used by batched rows, a client disconnect mid-stream, and /stats.batch."""

import threading

import httpx
import pytest

from srv_helpers import make_adapter, start_server, stop_server

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):",
           "print('hello')", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def adapter_a(llama_dir, tmp_path_factory):
    return make_adapter(llama_dir, tmp_path_factory.mktemp("lane-adapters") / "A", seed=1)


def _mount(s, path):
    r = httpx.post(s.v1 + "/adapters", json={"id": "A", "path": str(path)}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def bsrv(llama_dir, adapter_a):
    s = start_server(llama_dir, batch=4, prompt_cache_bytes=64 << 20, max_tokens=64)
    _mount(s, adapter_a)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def ssrv(llama_dir, adapter_a):
    """The same model without batching: every request on the serial lane."""
    s = start_server(llama_dir, prompt_cache_bytes=64 << 20, max_tokens=64, batch=1)
    _mount(s, adapter_a)
    yield s
    stop_server(s)


def _chat(url, content, **kw):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _concurrent_each(url, prompts, kws):
    out = [None] * len(prompts)

    def go(i):
        out[i] = _chat(url, prompts[i], **kws[i])
    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def _concurrent(url, prompts, **kw):
    return _concurrent_each(url, prompts, [kw] * len(prompts))


def _stats(url):
    return httpx.get(url + "/stats").json()["batch"]


def test_concurrent_batch_equals_serial_lane(bsrv, ssrv):
    serial = [_chat(ssrv.url, p) for p in PROMPTS]
    before = _stats(bsrv.url)
    batched = _concurrent(bsrv.url, PROMPTS)
    after = _stats(bsrv.url)
    assert after["lanes"]["batch"] - before["lanes"]["batch"] == len(PROMPTS)
    assert after["peak_rows"] >= 2 and after["batched"] and after["configured"] == 4
    for a, b in zip(serial, batched):
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]


def test_seeded_sampling_rows_in_batch_equal_serial_lane(bsrv, ssrv):
    """Seeded temperature sampling is batched (no serial-lane reason any more), and each
    row's tokens are the serial lane's for the same seed, whatever else is in the batch."""
    kws = [dict(seed=10 + i, temperature=0.9, top_p=0.95) for i in range(len(PROMPTS))]
    serial = [_chat(ssrv.url, p, **kw) for p, kw in zip(PROMPTS, kws)]
    before = _stats(bsrv.url)
    batched = _concurrent_each(bsrv.url, PROMPTS, kws)
    after = _stats(bsrv.url)
    assert after["lanes"]["batch"] - before["lanes"]["batch"] == len(PROMPTS)
    assert after["lanes"]["serial"] == before["lanes"]["serial"]
    assert "seed" not in after["serial_reasons"]
    texts = [a["choices"][0]["message"]["content"] for a in serial]
    assert len(set(texts)) > 1                   # sampling, not a constant answer
    for a, b in zip(serial, batched):
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    # and the seed matters: another seed, another text for at least one prompt
    other = _concurrent_each(bsrv.url, PROMPTS, [dict(kw, seed=kw["seed"] + 100) for kw in kws])
    assert any(o["choices"][0]["message"]["content"] != t for o, t in zip(other, texts))


def test_prompt_cache_filled_by_batched_rows(bsrv):
    p = "def fibonacci(n):\n    # a long enough prompt to be worth caching\n"
    first = _chat(bsrv.url, p, max_tokens=6)
    again = _chat(bsrv.url, p, max_tokens=6)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_stop_string_and_logprobs_in_batch(bsrv, ssrv):
    ref = _chat(ssrv.url, "def add(a, b):", logprobs=True, top_logprobs=2)
    text = ref["choices"][0]["message"]["content"]
    assert len(text) > 4
    outs = _concurrent(bsrv.url, ["def add(a, b):", "import os\n"], stop=[text[2:4]],
                       logprobs=True, top_logprobs=2)
    got = outs[0]["choices"][0]
    assert got["message"]["content"] == text[:text.find(text[2:4])]
    assert got["finish_reason"] == "stop"
    assert got["logprobs"]["content"][0] == ref["choices"][0]["logprobs"]["content"][0]


def test_disconnect_mid_stream_frees_the_row(bsrv):
    import time
    cancelled = httpx.get(bsrv.url + "/stats").json()["queue"]["cancelled"]
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 60,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", bsrv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    # the server keeps serving, and the cancelled row leaves the batch
    out = _concurrent(bsrv.url, PROMPTS[:3])
    assert all(o["choices"][0]["message"]["content"] for o in out)
    assert _stats(bsrv.url)["active_rows"] == 0
    for _ in range(50):
        if httpx.get(bsrv.url + "/stats").json()["queue"]["cancelled"] > cancelled:
            break
        time.sleep(0.1)
    assert httpx.get(bsrv.url + "/stats").json()["queue"]["cancelled"] > cancelled


def test_full_queue_gets_503_with_retry_after(bsrv):
    st = bsrv.state
    old = st.max_queue
    st.max_queue = 0
    try:
        r = httpx.post(bsrv.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        a = httpx.post(bsrv.url + "/v1/messages", timeout=30, json={
            "model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    finally:
        st.max_queue = old
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "overloaded_error"
    assert a.status_code == 503 and a.json()["error"]["type"] == "overloaded_error"
    assert _stats(bsrv.url)["rejected"] >= 2
    assert _chat(bsrv.url, "hi")["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_sdk_streams_mixed_lanes(bsrv, ssrv):
    """Official SDK, concurrent streams: requests with and without a per-request adapter mixed,
    all rows of the batch (each row with its own adapter)."""
    from openai import OpenAI
    client = OpenAI(base_url=bsrv.v1, api_key="sk-x", max_retries=0, timeout=120)
    ref = {p: _chat(ssrv.url, p)["choices"][0]["message"]["content"] for p in PROMPTS}
    ref_a = {p: _chat(ssrv.url, p, adapter="A")["choices"][0]["message"]["content"]
             for p in PROMPTS}
    assert ref != ref_a                          # the adapter changes the answers
    before = _stats(bsrv.url)
    out = {}

    def go(i, p):
        kw = {"extra_body": {"adapter": "A"}} if i % 3 == 0 else {}
        s = client.chat.completions.create(model="m", messages=[{"role": "user", "content": p}],
                                           max_tokens=12, temperature=0, stream=True, **kw)
        out[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    ts = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate(PROMPTS * 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == 2 * len(PROMPTS)
    for i, p in enumerate(PROMPTS * 2):
        assert out[i] == (ref_a if i % 3 == 0 else ref)[p], (i, p)
    after = _stats(bsrv.url)
    assert after["serial_reasons"].get("adapters", 0) == before["serial_reasons"].get("adapters", 0)
    assert after["lanes"]["batch"] - before["lanes"]["batch"] == 2 * len(PROMPTS)


def test_aggregate_admission_holds_rows_that_do_not_fit_together(llama_dir):
    """Budget for exactly one row: concurrent requests that each fit alone run one after
    another in the batch lane (none refused, none lost, same text); a request over the
    budget on its own is refused before any compute with the documented 400."""
    s = start_server(llama_dir, batch=4, prompt_cache_bytes=0, max_tokens=64)
    try:
        eng, adm = s.state.engine, s.state.admission
        first = _chat(s.url, "def add(a, b):")
        need = first["usage"]["prompt_tokens"] + 12
        lo, hi = adm.weights, adm.budget_bytes        # smallest budget that fits one row
        while hi - lo > 1:
            mid = (lo + hi) // 2
            adm.budget_bytes = mid
            lo, hi = (lo, mid) if eng.batch_fits([need]) else (mid, hi)
        adm.budget_bytes = hi
        assert eng.batch_fits([need]) and not eng.batch_fits([need, need])
        before = _stats(s.url)
        out = _concurrent(s.url, ["def add(a, b):"] * 3)
        after = _stats(s.url)
        assert [o["choices"][0]["message"]["content"] for o in out] == \
            [first["choices"][0]["message"]["content"]] * 3
        assert after["lanes"]["batch"] - before["lanes"]["batch"] == 3
        assert after["peak_rows"] == 1 and after["rejected"] == 0
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 64})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "memory_admission" and err["code"] == "context_over_budget"
        assert _chat(s.url, "hi")["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        stop_server(s)
