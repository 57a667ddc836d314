"""Admin routes, auth, error shapes, admission, server-side defaults (llama fixture)."""

import json
import uuid

import anthropic
import httpx
import openai
import pytest

import engine
from srv_helpers import start_server, stop_server

KEY = "sekrit-key"
CEILING_TARGET = 600


@pytest.fixture(scope="module")
def aux(llama_dir):
    from engine.step.admission import Admission
    model, _ = engine.load(llama_dir)
    budget = Admission.for_model(model).predicted_peak(CEILING_TARGET)
    s = start_server(llama_dir, api_key=KEY, memory_budget_bytes=budget,
                     max_body_bytes=64 * 1024, temperature=0.0, prompt_cache_bytes=64 << 20,
                     batch=1)
    s.budget = budget
    yield s
    stop_server(s)


def H(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def chat(aux, body, headers=None, path="/chat/completions"):
    return httpx.post(aux.v1 + path, json=body, headers=H() if headers is None else headers,
                      timeout=30)


def ok_body(n=2):
    return {"messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex[:6]}"}],
            "max_tokens": n}


def assert_openai_error(r, status, type_=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert isinstance(e["message"], str) and e["message"]
    assert set(e) >= {"message", "type", "param", "code"}
    if type_:
        assert e["type"] == type_
    return e


def test_health_exact_and_open(aux):
    r = httpx.get(aux.url + "/health")
    assert r.status_code == 200 and r.content == b'{"status": "ok"}'


def test_auth(aux):
    e = assert_openai_error(chat(aux, ok_body(), headers={}), 401, "authentication_error")
    assert "API key" in e["message"]
    assert_openai_error(chat(aux, ok_body(), headers=H("wrong")), 401)
    assert_openai_error(httpx.get(aux.url + "/stats"), 401)
    assert_openai_error(httpx.get(aux.url + "/v1/unknown"), 401)
    r = httpx.post(aux.v1 + "/messages", json={"max_tokens": 2, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["type"] == "error"
    assert chat(aux, ok_body()).status_code == 200
    assert chat(aux, ok_body(), headers={"x-api-key": KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=aux.v1, api_key="bad", max_retries=0).models.list()
    assert openai.OpenAI(base_url=aux.v1, api_key=KEY).models.list().data[0].id == \
        aux.state.model_id
    m = anthropic.Anthropic(base_url=aux.url, api_key=KEY, max_retries=0).messages.create(
        model="x", max_tokens=2, messages=[{"role": "user", "content": "hey"}])
    assert m.type == "message"


def test_models(aux):
    r = httpx.get(aux.v1 + "/models", headers=H()).json()
    assert r["object"] == "list" and r["data"][0]["id"] == aux.state.model_id
    assert r["data"][0]["object"] == "model"
    assert httpx.get(aux.v1 + f"/models/{aux.state.model_id}", headers=H()).status_code == 200
    assert_openai_error(httpx.get(aux.v1 + "/models/nope", headers=H()), 404)


def test_stats_schema(aux):
    body = ok_body(3)
    chat(aux, body)
    chat(aux, body)                       # same prompt again: a prompt-cache hit
    s = httpx.get(aux.url + "/stats", headers=H()).json()
    assert set(s) >= {"server", "prompt_cache", "response_store", "kv_quant", "admission",
                      "batch"}
    assert s["server"]["owner"] == "serve" and s["server"]["model"] == aux.state.model_id
    assert isinstance(s["server"]["started_at"], int)
    pc = s["prompt_cache"]
    assert set(pc) >= {"entries", "bytes", "max_bytes", "hits", "misses"}
    assert pc["max_bytes"] == 64 << 20 and pc["hits"] >= 1 and pc["entries"] >= 1
    assert 0 < pc["bytes"] <= pc["max_bytes"]
    assert s["response_store"]["max_bytes"] == 33554432
    assert s["response_store"]["ttl_ms"] == 3600000
    kv = s["kv_quant"]
    assert kv["mode"] == "bf16" and kv["layers"] == {"bf16": 2}
    assert kv["attention"] == {"global": 2, "sliding_window": 0}
    adm = s["admission"]
    assert adm["memory_budget_bytes"] == aux.budget == adm["usable_bytes"]
    assert CEILING_TARGET <= adm["max_safe_context"] < CEILING_TARGET + 10
    assert adm["weights_bytes"] == aux.state.admission.weights > 0
    assert s["batch"] == {"configured": 1, "batched": False, "active_rows": 0,
                          "available": False, "queued": 0, "max_queue": 16, "rejected": 0,
                          "rows_now": 0, "peak_rows": 1}


def test_stats_last_generation_clock(aux):
    """/stats queue.last_generation: the engine-side clock of the latest generation
    (what bench_server compares the client's clock with)."""
    body = {**ok_body(12), "logit_bias": {"1009": -100, "1016": -100, "1017": -100}}
    r = chat(aux, body)
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["completion_tokens"]
    assert n == 12
    last = httpx.get(aux.url + "/stats", headers=H()).json()["queue"]["last_generation"]
    assert last["generation_tokens"] == n
    assert 0 < last["first_text_s"] and 0 < last["decode_s"]
    assert last["decode_tps"] == (n - 1) / last["decode_s"]      # same float expression
    # the event loop streamed those tokens meanwhile: some CPU time, less than the span
    # (it is one thread, and the engine ran on another)
    assert 0 <= last["event_loop_cpu_s"] < last["decode_s"]
    # where the first token's time went: the server's queue, then the engine's phases, which
    # fit inside the first text's time (on the same clock, from the job's start)
    phases = [last[k] for k in ("waiting_s", "lookup_s", "prefill_s")]
    assert last["queue_s"] >= 0 and min(phases) >= 0 and last["prefill_s"] > 0
    # before the queue: the request's own preparation (body, template, tokens), from the
    # moment the HTTP request arrived
    assert 0 < last["prepare_s"] < r.elapsed.total_seconds()
    assert sum(phases) <= last["first_text_s"] + last["queue_s"]
    assert last["cached_tokens"] == r.json()["usage"].get("prompt_tokens_details", {}).get(
        "cached_tokens", 0)


def test_over_budget_400(aux):
    ceiling = aux.state.ceiling
    body = ok_body()
    body["max_tokens"] = ceiling          # prompt + max_tokens > ceiling
    e = assert_openai_error(chat(aux, body), 400, "memory_admission")
    assert e["code"] == "context_over_budget"
    assert str(ceiling) in e["message"]
    r = httpx.post(aux.v1 + "/messages", headers=H(), json={
        "max_tokens": ceiling, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_over_budget"
    r = httpx.post(aux.v1 + "/responses", headers=H(), json={
        "max_output_tokens": ceiling, "input": "x"})
    assert r.json()["error"]["type"] == "memory_admission"
    assert chat(aux, ok_body()).status_code == 200      # still serving


def test_oversized_body_413(aux):
    body = ok_body()
    body["messages"][0]["content"] = "x" * (70 * 1024)
    e = assert_openai_error(chat(aux, body), 413)
    assert "limit" in e["message"]
    # chunked upload without a Content-Length is counted too
    data = json.dumps(body).encode()
    r = httpx.post(aux.v1 + "/chat/completions", headers=H(),
                   content=iter([data[i:i + 4096] for i in range(0, len(data), 4096)]))
    assert r.status_code == 413
    assert chat(aux, ok_body()).status_code == 200


BAD = [
    (b"{not json", "invalid JSON"),
    (b"[1, 2]", "expected an object"),
    (b"", "empty"),
    (json.dumps({"max_tokens": 2}).encode(), "messages required"),
    (json.dumps({"messages": []}).encode(), "messages required"),
    (json.dumps({"messages": "hi"}).encode(), "array"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "role"),
    (json.dumps({**ok_body(), "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({**ok_body(), "temperature": True}).encode(), "temperature"),
    (json.dumps({**ok_body(), "top_p": 2}).encode(), "top_p"),
    (json.dumps({**ok_body(), "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({**ok_body(), "max_tokens": 2.5}).encode(), "max_tokens"),
    (json.dumps({**ok_body(), "stop": 7}).encode(), "stop"),
    (json.dumps({**ok_body(), "logit_bias": {"abc": 1}}).encode(), "logit_bias"),
    (json.dumps({**ok_body(), "logit_bias": {"999999": 1}}).encode(), "vocabulary"),
    (json.dumps({**ok_body(), "n": 3}).encode(), "n > 1"),
    (json.dumps({**ok_body(), "adapter": "ghost"}).encode(), 'unknown adapter "ghost"'),
    (json.dumps({**ok_body(), "top_logprobs": 50}).encode(), "top_logprobs"),
    (json.dumps({**ok_body(), "tools": [{"type": "function", "function": {}}]}).encode(),
     "name"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}}]}]}).encode(), "vision"),
]


@pytest.mark.parametrize("raw,needle", BAD, ids=[n for _, n in BAD])
def test_bad_input_400(aux, raw, needle):
    r = httpx.post(aux.v1 + "/chat/completions", content=raw,
                   headers={**H(), "content-type": "application/json"})
    e = assert_openai_error(r, 400)
    assert needle in e["message"], e


def test_prompt_build_failure_400(srv):
    # the qwen3 template raises when there is no user message
    r = httpx.post(srv.v1 + "/chat/completions", json={
        "messages": [{"role": "system", "content": "only system"}], "max_tokens": 2})
    e = assert_openai_error(r, 400)
    assert e["message"].startswith("prompt build failed")


def test_unknown_route_and_method(aux):
    e = assert_openai_error(httpx.get(aux.v1 + "/nope", headers=H()), 404, "not_found_error")
    assert "/v1/nope" in e["message"]
    assert_openai_error(httpx.get(aux.v1 + "/chat/completions", headers=H()), 405)
    assert_openai_error(httpx.delete(aux.v1 + "/adapters/ghost", headers=H()), 404)
    r = httpx.post(aux.v1 + "/messages/nope", headers=H(), json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_server_default_temperature_wins_over_generation_config(aux):
    # llama's generation_config says temperature 0.6; --temperature 0 makes requests greedy
    msgs = [{"role": "user", "content": f"q {uuid.uuid4().hex[:6]}"}]
    a = chat(aux, {"messages": msgs, "max_tokens": 8, "seed": 1}).json()
    b = chat(aux, {"messages": msgs, "max_tokens": 8, "seed": 2}).json()
    ref = aux.generate(msgs, max_tokens=8, temperature=0.0)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"] \
        == ref.text
    # an explicit request value still wins over the server flag
    c = chat(aux, {"messages": msgs, "max_tokens": 8, "seed": 3, "temperature": 1.0}).json()
    refc = aux.generate(msgs, max_tokens=8, temperature=1.0,
                           seed=3)
    assert c["choices"][0]["message"]["content"] == refc.text


def test_error_shapes_per_protocol(aux):
    big = "x" * (70 * 1024)
    # Anthropic routes: {type: error, error: {type, message}} with Anthropic's type names
    r = httpx.post(aux.v1 + "/messages", headers=H(), json={
        "max_tokens": 2, "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(aux.v1 + "/messages/count_tokens", headers=H(), json={
        "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.get(aux.v1 + "/messages", headers=H())
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.APIStatusError) as e:
        anthropic.Anthropic(base_url=aux.url, api_key=KEY, max_retries=0).messages.create(
            model="x", max_tokens=2, messages=[{"role": "user", "content": big}])
    assert e.value.status_code == 413
    # Responses and admin routes: the OpenAI shape
    r = httpx.post(aux.v1 + "/responses", headers=H(), json={"input": big})
    e = assert_openai_error(r, 413, "request_too_large")
    r = httpx.post(aux.v1 + "/adapters", headers=H(), json={"id": "x", "path": big})
    assert_openai_error(r, 413)
    assert_openai_error(httpx.post(aux.v1 + "/adapters", content=b"{", headers={
        **H(), "content-type": "application/json"}), 400)
    assert_openai_error(httpx.get(aux.v1 + "/responses/resp_x", headers=H()), 404)
    assert chat(aux, ok_body()).status_code == 200      # still serving
