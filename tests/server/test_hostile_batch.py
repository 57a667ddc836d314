"""The 'poison row': on a batching server (--batch 4) a request whose options the
batched sampler cannot take (seed -1: mx.random.key wants a uint64) is a 400 from
`SamplingParams` before it is queued, on every protocol, and the streams decoding
in the batch at the time finish with the text they give alone (llama fixture)."""

import threading

import httpx
import pytest

from srv_helpers import start_server, stop_server, stream_chat_text

EOS = {"1009": -100, "1016": -100, "1017": -100}     # the llama fixture's end tokens
N = 48


@pytest.fixture(scope="module")
def b4(llama_dir):
    s = start_server(llama_dir, batch=4, max_tokens=8, temperature=0.0)
    yield s
    stop_server(s)


def _stream(url, prompt, out):
    out.append(stream_chat_text(url, prompt, N, logit_bias=EOS))


def _poison(path):
    if path == "/v1/completions":
        body = {"prompt": "hi"}
    elif path == "/v1/responses":
        body = {"input": "hi", "max_output_tokens": 4}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/messages":
        body["max_tokens"] = 4
    return {**body, "seed": -1, "temperature": 0.5}


def test_negative_seed_is_400_and_the_batch_survives(b4):
    prompts = ["innocent one", "innocent two"]
    solo = []
    for p in prompts:
        _stream(b4.url, p, solo)
    assert all(solo)
    rows_before = b4.state.engine.stats()["lanes"].get("batch", 0)
    got = [[] for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(b4.url, p, g)) for p, g in zip(prompts, got)]
    for t in threads:
        t.start()
    for _ in range(3):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
            for stream in (False, True):
                r = httpx.post(b4.url + path, json={**_poison(path), "stream": stream}, timeout=10)
                assert r.status_code == 400, (path, r.text)
                err = r.json()["error"]
                assert err["message"].startswith("seed "), err
                if path != "/v1/messages":
                    assert err["param"] == "seed", err
    # a seed at the top of the range joins the batch and is served
    r = httpx.post(b4.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 64 - 1,
        "temperature": 0.7, "max_tokens": 4})
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(60)
    assert [g[0] for g in got] == solo
    assert b4.state.engine.stats()["lanes"].get("batch", 0) > rows_before   # batched lane
