"""The served OpenAPI document describes the real API, and the API keeps to it.

- `/openapi.json` lists every operation with its request model and its response
  bodies (the 200 body, `text/event-stream` where it streams, and each error
  status in the protocol's own error shape; never FastAPI's 422).
- A body the models refuse is a 400 in the protocol's shape naming the field.
- Schema fuzzing (schemathesis) against the served document on a live server:
  no 5xx, no hang (a per-request timeout), every response's status, content type
  and body conform to the document, and every request the document calls invalid is
  refused with a documented 4xx. Hypothesis generates `MLXP_FUZZ_EXAMPLES` (default 20)
  valid and as many invalid requests per operation (`MLXP_FUZZ_MODES`, default
  `positive,negative`); `MLXP_FUZZ_COVERAGE=1` adds schemathesis' coverage phase
  (boundary and type-violating values of every field, ~2,500 more calls).
"""

import os
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                response_headers_conformance,
                                                response_schema_conformance,
                                                status_code_conformance)

EXAMPLES = int(os.environ.get("MLXP_FUZZ_EXAMPLES", "20"))
COVERAGE = os.environ.get("MLXP_FUZZ_COVERAGE", "0") == "1"
MODES = [GenerationMode(m)
         for m in os.environ.get("MLXP_FUZZ_MODES", "positive,negative").split(",")]
REQUEST_TIMEOUT_S = 20.0          # a hang is a failure, not a stuck test run
MAX_NEW_TOKENS = 4                # keep fuzzed generations short on the CPU
OPERATIONS = {("get", "/health"), ("get", "/v1"), ("get", "/v1/models"),
              ("get", "/v1/models/{model_id}"), ("get", "/stats"), ("get", "/v1/adapters"),
              ("post", "/v1/adapters"), ("delete", "/v1/adapters/{adapter_id}"),
              ("post", "/v1/chat/completions"), ("post", "/v1/completions"),
              ("post", "/v1/embeddings"), ("post", "/v1/messages"), ("post", "/v1/messages/count_tokens"),
              ("post", "/v1/responses"), ("get", "/v1/responses/{response_id}"),
              ("delete", "/v1/responses/{response_id}"), ("get", "/metrics")}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
if GenerationMode.NEGATIVE in MODES:         # a request the document calls invalid is a 4xx
    CHECKS.append(negative_data_rejection)
SEEN = Counter()                            # (mode, status) of every fuzzed call


@pytest.fixture(scope="module")
def api(llama_dir, tmp_path_factory):
    from server.app import create_app, security_for
    from server.cli import BackgroundServer
    from server.state import ServerConfig, build_state

    cfg = ServerConfig(model=str(llama_dir), max_tokens=MAX_NEW_TOKENS, temperature=0.0,
                       prompt_cache_bytes=32 << 20, batch=2)
    state = build_state(cfg)
    roots = (str(tmp_path_factory.mktemp("fuzz-adapters")),)
    bg = BackgroundServer(create_app(state, security_for(cfg, adapter_dirs=roots))).start()
    yield bg
    bg.stop()
    state.gateway.close()
    if SEEN:
        print("\nfuzzed calls by (mode, status):", dict(sorted(SEEN.items())),
              "total", sum(SEEN.values()))


@pytest.fixture(scope="module")
def fuzz_schema(api):
    schema = schemathesis.openapi.from_url(api.url + "/openapi.json")
    schema.config.generation.update(modes=MODES)
    schema.config.phases.coverage.enabled = COVERAGE
    return schema


def test_document_lists_every_operation_with_its_models(api):
    doc = httpx.get(api.url + "/openapi.json").json()
    ops = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert ops == OPERATIONS
    text = str(doc)
    assert "422" not in doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "HTTPValidationError" not in text
    schemas = doc["components"]["schemas"]
    for path, model, err in (("/v1/chat/completions", "ChatCompletionRequest", "OpenAIError"),
                             ("/v1/completions", "CompletionRequest", "OpenAIError"),
                             ("/v1/messages", "MessagesRequest", "AnthropicError"),
                             ("/v1/responses", "ResponsesRequest", "OpenAIError"),
                             ("/v1/adapters", "AdapterMount", "OpenAIError")):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model), (path, ref)
        for code in ("400", "413", "415"):
            got = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert got.endswith("/" + err), (path, code, got)
        if path != "/v1/adapters":
            assert "text/event-stream" in op["responses"]["200"]["content"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    temp = next(a for a in chat["properties"]["temperature"]["anyOf"] if a["type"] == "number")
    assert (temp["minimum"], temp["maximum"]) == (0, 2)
    assert schemas["MessagesRequest"]["required"] == ["messages", "max_tokens"]
    assert set(schemas["Thinking"]["properties"]["type"]["enum"]) == {"enabled", "disabled",
                                                                  "adaptive"}


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": "2"}, "max_tokens", "must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "must be a boolean"),
    ("/v1/completions", {"prompt": "hi", "top_k": -1}, "top_k", "must be >= 0"),
    ("/v1/responses", {"input": "hi", "store": "yes"}, "store", "must be a boolean"),
    ("/v1/responses", {"max_output_tokens": 2}, "input", "input required"),
    ("/v1/adapters", {"id": "x"}, "path", "path required"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens",
     "max_tokens required"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "bot", "content": "hi"}]},
     "messages", "messages[0].role must be one of"),
])
def test_refused_bodies_keep_the_protocol_shape(api, path, body, param, needle):
    r = httpx.post(api.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    if path.startswith("/v1/messages"):
        assert r.json()["type"] == "error"
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and set(err) == {"type", "message"}
    else:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert needle in err["message"], err
    assert "detail" not in r.json()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/adapters"])
def test_guards_run_before_the_models(api, path):
    """The raw-byte guards answer before FastAPI parses or validates anything: a
    10,000-deep body is the depth guard's quick 400 (not a parser error), a text/plain
    body the content-type guard's 415."""
    deep = b'{"x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    t0 = time.monotonic()
    r = httpx.post(api.url + path, content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and time.monotonic() - t0 < 3.0
    body = r.json()
    err = body["error"]
    assert "nested 10001 levels" in err["message"] and "--max-json-depth" in err["message"]
    assert (body.get("type") == "error") == path.startswith("/v1/messages")
    r = httpx.post(api.url + path, content=b'{"messages": []}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415


def test_lone_surrogates_are_400_pairs_are_text(api):
    """`"\\ud800"` is valid JSON but not Unicode text (it cannot be encoded): refused with
    a 400 before any handler; an escaped pair (an emoji, as `json.dumps` writes it) is text."""
    for path in ("/v1/chat/completions", "/v1/messages"):
        raw = b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800"}]}'
        r = httpx.post(api.url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "surrogate" in r.text, r.text
    raw = b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
    r = httpx.post(api.url + "/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def _bounded(case) -> None:
    """Fuzzed generations stay short: a larger token limit is capped (absent: the
    server's default, also short)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(key)        # (an integral float is a valid count too: 1e9)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_NEW_TOKENS:
            body[key] = MAX_NEW_TOKENS


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True, database=None)
def test_schema_fuzzing_conforms(case, api):
    _bounded(case)
    t0 = time.monotonic()
    r = case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT_S)
    SEEN[(case.meta.generation.mode.value if case.meta else "?", r.status_code)] += 1
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S
