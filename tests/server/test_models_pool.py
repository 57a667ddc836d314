"""Several models in one server (issue #40): the request's `model` picks one; each model
keeps its own engine; two models at once give each model's single-model tokens."""

from __future__ import annotations

import threading

import httpx
import pytest

from pool_helpers import chat_body, chat_ids, start_pool, stream_ids
from srv_helpers import start_server, stop_server

N = 24


@pytest.fixture(scope="module")
def two(qwen_dir, llama_dir):
    s = start_pool([f"qwen={qwen_dir}", f"llama={llama_dir}"], 2_000_000_000, batch=4)
    yield s
    s.stop()


def test_models_lists_both_with_context(two):
    r = httpx.get(two.url + "/v1/models")
    assert r.status_code == 200
    cards = {c["id"]: c for c in r.json()["data"]}
    assert list(cards) == ["qwen", "llama"]
    assert cards["qwen"]["context_length"] == 4096
    assert cards["llama"]["context_length"] == 131072
    assert cards["qwen"]["model_type"] == "qwen3" and cards["llama"]["model_type"] == "llama"
    one = httpx.get(two.url + "/v1/models/llama").json()
    assert one["id"] == "llama" and one["max_model_len"] == 131072


def _single_refs(model_dir, prompts):
    """Each prompt's greedy tokens on a one-model server (today's path)."""
    s = start_server(model_dir, batch=4)
    try:
        return [chat_ids(s.url, chat_body(None, p, N)) for p in prompts]
    finally:
        stop_server(s)


def test_two_models_at_once_equal_their_single_model_runs(two, qwen_dir, llama_dir):
    prompts = ["tell me a story", "what is two plus two", "hello there"]
    refs = {"qwen": _single_refs(qwen_dir, prompts), "llama": _single_refs(llama_dir, prompts)}
    assert refs["qwen"] != refs["llama"]          # the two models answer differently
    got, errors = {}, []
    start = threading.Barrier(2 * len(prompts))

    def run(model, i, stream):
        try:
            start.wait(30)
            body = chat_body(model, prompts[i], N)
            got[model, i] = stream_ids(two.url, body) if stream else chat_ids(two.url, body)
        except BaseException as e:        # (reported below)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(m, i, i % 2 == 0))
               for m in ("qwen", "llama") for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for m in ("qwen", "llama"):
        for i in range(len(prompts)):
            assert got[m, i] == refs[m][i], (m, i)
    st = httpx.get(two.url + "/stats").json()
    assert st["models"]["resident"] == ["qwen", "llama"]
    assert st["models"]["loads"] == 2          # each loaded once
    # each model has its own engine: its own prompt cache and counters
    assert st["loaded"]["qwen"]["queue"]["completed"] >= len(prompts)
    assert st["loaded"]["llama"]["queue"]["completed"] >= len(prompts)
    assert two.pool.slots["qwen"].state.engine is not two.pool.slots["llama"].state.engine
    assert (two.pool.slots["qwen"].state.prompt_cache
            is not two.pool.slots["llama"].state.prompt_cache)


def test_answers_name_the_model_and_absent_model_is_the_first(two):
    r = httpx.post(two.url + "/v1/chat/completions", json=chat_body("llama", "hi", 2))
    assert r.json()["model"] == "llama"
    r = httpx.post(two.url + "/v1/chat/completions", json=chat_body(None, "hi", 2))
    assert r.status_code == 200 and r.json()["model"] == "qwen"
    r = httpx.post(two.url + "/v1/messages", json=chat_body("llama", "hi", 2))
    assert r.status_code == 200 and r.json()["model"] == "llama"
    r = httpx.post(two.url + "/v1/completions",
                   json={"model": "llama", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "llama"
    r = httpx.post(two.url + "/v1/messages/count_tokens",
                   json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_responses_store_is_shared_across_models(two):
    r = httpx.post(two.url + "/v1/responses",
                   json={"model": "llama", "input": "hi", "max_output_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "llama"
    rid = r.json()["id"]
    assert httpx.get(f"{two.url}/v1/responses/{rid}").json()["id"] == rid
    r2 = httpx.post(two.url + "/v1/responses", json={
        "model": "qwen", "input": "more", "max_output_tokens": 3, "previous_response_id": rid})
    assert r2.status_code == 200 and r2.json()["model"] == "qwen"


def test_embeddings_pick_the_model(two):
    a = httpx.post(two.url + "/v1/embeddings", json={"model": "qwen", "input": "hi"})
    b = httpx.post(two.url + "/v1/embeddings", json={"model": "llama", "input": "hi"})
    assert a.status_code == b.status_code == 200
    assert a.json()["model"] == "qwen" and b.json()["model"] == "llama"
    assert a.json()["data"][0]["embedding"] != b.json()["data"][0]["embedding"]


UNKNOWN = ["nope", "../../etc", "../../../etc/passwd", "/etc", "qwen/../llama", "QWEN", "",
           "x" * 5000]


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_model_is_a_404_in_each_protocol(two, name):
    msgs = [{"role": "user", "content": "hi"}]
    openai_routes = [("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
                     ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                     ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                     ("/v1/embeddings", {"input": "hi"})]
    for path, body in openai_routes:
        r = httpx.post(two.url + path, json={**body, "model": name})
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found"
        assert err["param"] == "model" and "/work" not in err["message"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(two.url + path, json={"model": name, "messages": msgs, "max_tokens": 2})
        assert r.status_code == 404, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    if name and ".." not in name:      # (a client folds ".." out of a URL path)
        r = httpx.get(two.url + "/v1/models/" + name)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    st = httpx.get(two.url + "/stats").json()["models"]
    assert set(st["per_model"]) <= {"qwen", "llama"}     # nothing was loaded for it


def test_metrics_show_models(two):
    httpx.post(two.url + "/v1/chat/completions", json=chat_body("qwen", "hi", 2))
    text = httpx.get(two.url + "/metrics").text
    assert "engine_models_resident 2.0" in text
    assert "engine_models_loads_total 2.0" in text
    assert 'engine_model_resident{model="qwen"} 1.0' in text
    assert 'engine_models_evictions_total{reason="lru"} 0.0' in text
    done = [ln for ln in text.splitlines()
            if ln.startswith('engine_generations_completed_total{model="qwen"}')]
    assert done and float(done[0].split()[-1]) >= 1


def test_one_model_still_ignores_the_model_field(srv):
    """One model served: any `model` (even an unknown or hostile one) is answered, as before."""
    for name in ("gpt-4o", "../../etc", None):
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(name, "hi", 2))
        assert r.status_code == 200 and r.json()["model"] == srv.state.model_id
    data = httpx.get(srv.url + "/v1/models").json()["data"]
    assert len(data) == 1 and "loaded" not in data[0]
    assert "models" not in httpx.get(srv.url + "/stats").json()


def test_adapters_are_per_model(tmp_path, qwen_dir):
    import tempfile

    from server.app import security_for
    from server.state import ServerConfig
    from srv_helpers import make_adapter

    ad = make_adapter(qwen_dir, tmp_path / "ad", seed=3)
    sec = security_for(ServerConfig(), adapter_dirs=(tempfile.gettempdir(),))
    s = start_pool([f"a={qwen_dir}", f"b={qwen_dir}"], 2_000_000_000, security=sec)
    try:
        r = httpx.post(s.url + "/v1/adapters", json={"model": "b", "path": str(ad), "id": "x"})
        assert r.status_code == 200, r.text
        listed = httpx.get(s.url + "/v1/adapters").json()["models"]
        assert [m["id"] for m in listed["b"]["adapters"]] == ["x"]
        assert "a" not in listed or listed["a"]["adapters"] == []
        base = chat_ids(s.url, chat_body("b", "hello", 8))
        tuned = chat_ids(s.url, chat_body("b", "hello", 8, adapter="x"))
        assert tuned != base                                   # the adapter is on b
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body("a", "hi", 2, adapter="x"))
        assert r.status_code == 400                            # and not on a
        r = httpx.delete(s.url + "/v1/adapters/x", params={"model": "b"})
        assert r.status_code == 200
        assert httpx.get(s.url + "/v1/adapters").json()["models"]["b"]["adapters"] == []
    finally:
        s.stop()


def test_pages_and_documents_still_serve(two):
    assert httpx.get(two.url + "/health").status_code == 200
    assert httpx.get(two.url + "/").status_code == 200
    doc = httpx.get(two.url + "/openapi.json").json()
    assert "several" in doc["info"]["description"]
    assert httpx.get(two.url + "/v1").status_code == 200
    r = httpx.delete(two.url + "/v1/adapters/x", params={"model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
