"""`POST /v1/embeddings` on a live server: the OpenAI shape, float and base64 encodings,
`dimensions`, token-id input, bad input as a 400 naming the field, the official `openai`
SDK, the pooling setting, and an embeddings request answered while a generation runs."""

import base64
import json
import threading
import time

import httpx
import mlx.core as mx
import numpy as np
import pytest

import engine
from srv_helpers import NO_EOS

TEXTS = ["the first text", "a second, longer text to embed", "third"]


def post(srv, body, **kw):
    return httpx.post(srv.url + "/v1/embeddings", json=body, timeout=60, **kw)


def reference(srv, inputs, **kw):
    """The engine's own vectors on the server's model (in-process, on its worker)."""
    pooling = kw.pop("pooling", srv.state.embeddings_pooling)
    out = srv.on_worker(engine.embed, srv.model, srv.tokenizer, inputs, pooling=pooling, **kw)
    return np.array(out.vectors), out.prompt_tokens


def test_openai_sdk_embeddings_create(oai, srv):
    want, n = reference(srv, TEXTS)
    # unset: the SDK asks base64 and decodes it itself; base64 asked: the caller decodes
    for fmt in ("float", "base64", None):
        kw = {} if fmt is None else {"encoding_format": fmt}
        r = oai.embeddings.create(model="anything", input=TEXTS, **kw)
        assert r.object == "list" and r.model == srv.state.model_id
        assert [d.index for d in r.data] == [0, 1, 2]
        assert all(d.object == "embedding" for d in r.data)
        if fmt == "base64":
            got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                            for d in r.data])
        else:
            got = np.array([d.embedding for d in r.data], dtype=np.float32)
        assert np.array_equal(got, want), fmt
        assert r.usage.prompt_tokens == r.usage.total_tokens == n
    one = oai.embeddings.create(model="m", input=TEXTS[1], dimensions=16)
    assert np.array_equal(np.array(one.data[0].embedding, dtype=np.float32),
                          reference(srv, TEXTS[1], dimensions=16)[0][0])


def test_wire_shape_and_base64_round_trip(srv):
    r = post(srv, {"input": TEXTS, "model": "x"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["usage"] == {"prompt_tokens": reference(srv, TEXTS)[1],
                             "total_tokens": reference(srv, TEXTS)[1]}
    floats = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    b = post(srv, {"input": TEXTS, "encoding_format": "base64"}).json()
    for i, d in enumerate(b["data"]):
        raw = base64.b64decode(d["embedding"])
        assert len(raw) == 4 * floats.shape[1]
        assert np.array_equal(np.frombuffer(raw, dtype="<f4"), floats[i])
    norms = np.linalg.norm(floats, axis=1)
    assert np.all(np.abs(norms - 1) < 1e-6)


def test_token_id_inputs(srv):
    ids = [list(srv.tokenizer.encode(t)) for t in TEXTS]
    by_text = post(srv, {"input": TEXTS}).json()["data"]
    by_ids = post(srv, {"input": ids}).json()["data"]
    assert [d["embedding"] for d in by_ids] == [d["embedding"] for d in by_text]
    single = post(srv, {"input": ids[0]}).json()
    assert len(single["data"]) == 1 and single["data"][0]["embedding"] == by_text[0]["embedding"]
    assert single["usage"]["prompt_tokens"] == len(ids[0])


def test_dimensions(srv):
    for d in (1, 8, 64):
        data = post(srv, {"input": TEXTS, "dimensions": d}).json()["data"]
        got = np.array([x["embedding"] for x in data], dtype=np.float32)
        assert got.shape == (3, d)
        assert np.array_equal(got, reference(srv, TEXTS, dimensions=d)[0])


def test_pooling_setting(srv):
    assert srv.state.embeddings_pooling == "last"       # the default (no 1_Pooling config)
    last = post(srv, {"input": TEXTS}).json()["data"]
    srv.state.embeddings_pooling = "mean"
    try:
        mean = post(srv, {"input": TEXTS}).json()["data"]
    finally:
        srv.state.embeddings_pooling = "last"
    got = np.array([d["embedding"] for d in mean], dtype=np.float32)
    assert np.array_equal(got, reference(srv, TEXTS, pooling="mean")[0])
    assert not np.array_equal(got, np.array([d["embedding"] for d in last], dtype=np.float32))


def test_cli_flag():
    from server.cli import config_from_args, parser
    args = parser().parse_args(["--embeddings-pooling", "mean"])
    assert config_from_args(args).embeddings_pooling == "mean"
    assert config_from_args(parser().parse_args([])).embeddings_pooling is None
    with pytest.raises(SystemExit):
        parser().parse_args(["--embeddings-pooling", "cls"])


@pytest.mark.parametrize("body,param,needle", [
    ({"input": []}, "input", "input is empty"),
    ({"input": ""}, "input", "input is an empty string"),
    ({"input": ["ok", ""]}, "input[1]", "input[1] is an empty string"),
    ({"input": [[1, 2], []]}, "input[1]", "input[1] has no tokens"),
    ({"input": [[1, 2], [3, 1024]]}, "input[1]", "token id 1024 is outside the vocabulary"),
    ({"input": [-5]}, "input[0]", "token id -5 is outside"),
    ({"input": 5}, "input", "input must be a string"),
    ({"input": [1.5]}, "input[0]", "must be a string or a list of token ids"),
    ({"input": [{"text": "x"}]}, "input[0]", "must be a string or a list of token ids"),
    ({"input": ["x"] * 2049}, "input", "the limit is 2048"),
    ({"input": [[7] * 4097]}, "input[0]", "has 4097 tokens; this model's context is"),
    ({}, "input", "input required"),
    ({"input": "x", "dimensions": 0}, "dimensions", "must be >= 1"),
    ({"input": "x", "dimensions": 65}, "dimensions", "at most 64"),
    ({"input": "x", "dimensions": "8"}, "dimensions", "must be an integer"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "must be one of"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else None)
def test_bad_input_is_400_naming_the_field(srv, body, param, needle):
    r = post(srv, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"], err["message"]
    assert post(srv, {"input": "still fine"}).status_code == 200


def test_openapi_lists_the_route(srv):
    doc = httpx.get(srv.url + "/openapi.json").json()
    op = doc["paths"]["/v1/embeddings"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/EmbeddingRequest")
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/EmbeddingList")
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/OpenAIError")
    assert "POST /v1/embeddings" in httpx.get(srv.url + "/v1").json()["endpoints"]


def test_answered_while_a_generation_runs(srv):
    """The forward runs between two decode steps: the generation is still streaming when
    the embeddings answer arrives (a call that waited for the engine to drain could not)."""
    want = reference(srv, TEXTS)[0]
    first, done = threading.Event(), threading.Event()
    stop = threading.Event()

    def stream():
        body = {"prompt": "count", "max_tokens": 3000, "stream": True, "logit_bias": NO_EOS,
                "temperature": 0}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first.set()
                if stop.is_set():
                    break
        done.set()
    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(60)
        t0 = time.monotonic()
        r = post(srv, {"input": TEXTS})
        assert r.status_code == 200 and not done.is_set(), "waited for the generation"
        assert time.monotonic() - t0 < 30
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        assert np.array_equal(got, want)
    finally:
        stop.set()
        t.join(120)
    mx.synchronize()


def test_no_adapter_is_applied(srv, qwen_dir, tmp_path):
    """Embeddings read the base model, even while a mounted adapter is the active one, and
    the active set is the same afterwards (a running request keeps its adapter)."""
    from srv_helpers import make_adapter
    base = reference(srv, TEXTS)[0]
    path = make_adapter(qwen_dir, tmp_path / "emb-a", seed=5)
    r = httpx.post(srv.url + "/v1/adapters", json={"id": "emb-a", "path": str(path)},
                   timeout=60)
    assert r.status_code == 200, r.text
    try:
        srv.on_worker(srv.state.adapters.activate, ("emb-a",))
        tuned = reference(srv, TEXTS)[0]
        assert not np.array_equal(tuned, base)
        got = np.array([d["embedding"] for d in post(srv, {"input": TEXTS}).json()["data"]],
                       dtype=np.float32)
        assert np.array_equal(got, base)
        assert np.array_equal(reference(srv, TEXTS)[0], tuned)     # still active after
    finally:
        srv.on_worker(srv.state.adapters.activate, ())
        assert httpx.delete(srv.url + "/v1/adapters/emb-a", timeout=60).status_code == 200
