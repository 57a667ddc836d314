"""Hostile input: every case is a quick 4xx in the protocol's own error shape, and a
normal request succeeds right after it (llama fixture behind a real uvicorn server).

Limits are set small here so that the cases stay fast; the defaults are checked in
test_hostile_cli.py."""

import json
import os
import socket
import threading
import time
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.served import raw_exchange
from srv_helpers import make_adapter, stream_chat_text

KEY = "hostile-key"
GOOD = "http://good.example"
EVIL = "http://evil.example"
MAX_BODY = 256 * 1024
MAX_CHARS = 20_000
BOUND_S = 3.0               # every refusal comes back within this
EOS = {"1009": -100, "1016": -100, "1017": -100}
JSON_POSTS = ["/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/messages",
              "/v1/messages/count_tokens", "/v1/responses", "/v1/embeddings", "/v1/adapters"]
OPERATIONS = [("GET", "/health"), ("GET", "/v1"), ("GET", "/v1/models"),
              ("GET", "/v1/models/x"), ("GET", "/stats"), ("GET", "/v1/adapters"),
              ("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/x"),
              ("POST", "/v1/chat/completions"), ("POST", "/chat/completions"),
              ("POST", "/v1/completions"), ("POST", "/v1/messages"),
              ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
              ("POST", "/v1/embeddings"),
              ("GET", "/v1/responses/x"), ("DELETE", "/v1/responses/x"),
              ("GET", "/openapi.json")]


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    inside, outside = base / "adapters", base / "outside"
    inside.mkdir()
    outside.mkdir()
    return inside, outside


@pytest.fixture(scope="module")
def hs(llama_dir, roots):
    """A server with small limits, an API key, one granted origin and one adapter root."""
    from server.app import create_app
    from server.cli import BackgroundServer
    from server.limits import BodyLimits
    from server.security import SecurityConfig
    from server.state import ServerConfig, build_state

    cfg = ServerConfig(model=str(llama_dir), api_key=KEY, max_tokens=8, temperature=0.0,
                       prompt_cache_bytes=32 << 20, max_body_bytes=MAX_BODY)
    state = build_state(cfg)
    sec = SecurityConfig(api_key=KEY, cors_origins=(GOOD,), allowed_hosts=("127.0.0.1",),
                         adapter_dirs=(str(roots[0]),), max_adapter_bytes=4 << 20,
                         limits=BodyLimits(max_body_bytes=MAX_BODY, max_json_depth=64,
                                           max_prompt_chars=MAX_CHARS, body_timeout_s=1.0))
    bg = BackgroundServer(create_app(state, sec), header_timeout_s=1.0).start()
    bg.state = state
    yield bg
    bg.stop()
    state.gateway.close()


def H(**extra):
    return {"Authorization": f"Bearer {KEY}", **extra}


def post(hs, path, body=None, *, content=None, headers=None, timeout=10.0):
    hdrs = H() if headers is None else headers
    if content is None:
        content = json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **hdrs}
    t0 = time.monotonic()
    r = httpx.post(hs.url + path, content=content, headers=hdrs, timeout=timeout)
    r.elapsed_s = time.monotonic() - t0
    return r


def assert_error(r, status, path, type_=None):
    """Status, the protocol's error shape, no internals in the message, quick."""
    assert r.status_code == status, (path, r.status_code, r.text[:300])
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}
        err = body["error"]
    else:
        err = body["error"]
        assert set(err) >= {"message", "type", "param", "code"}
    if type_:
        assert err["type"] == type_, err
    msg = err["message"]
    assert msg and "Error:" not in msg and "Traceback" not in msg and "/tmp/" not in msg
    assert "incompatible function arguments" not in msg
    assert getattr(r, "elapsed_s", 0) < BOUND_S
    return err


def normal(hs):
    """A normal request succeeds (called right after every hostile case)."""
    r = post(hs, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": f"hi {uuid.uuid4().hex[:6]}"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def minimal(path):
    return {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/responses": {"input": "hi", "max_output_tokens": 2},
            "/v1/messages": {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/adapters": {"id": "z", "path": "nowhere"},
            "/v1/embeddings": {"input": "hi"},
            }.get(path, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.mark.parametrize("path", JSON_POSTS)
def test_deep_json_is_400(hs, path):
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 10_000 + \
        b"]" * 10_000 + b"}"
    err = assert_error(post(hs, path, content=deep, headers=H(**{
        "content-type": "application/json"})), 400, path)
    assert "nested 10001 levels" in err["message"] and "--max-json-depth" in err["message"]
    # brackets inside strings are text, not nesting
    body = {**minimal(path), "metadata": {"note": "[" * 5000}}
    r = post(hs, path, body)
    assert r.status_code != 400 or "nested" not in r.text
    normal(hs)


@pytest.mark.parametrize("path", JSON_POSTS)
def test_body_over_the_limit_is_413(hs, path):
    big = {**minimal(path), "pad": "x" * MAX_BODY}
    assert_error(post(hs, path, big), 413, path, type_="request_too_large")

    def chunks():                         # no Content-Length: counted while read
        yield b'{"pad": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'
    r = httpx.post(hs.url + path, content=chunks(), timeout=10,
                   headers=H(**{"content-type": "application/json"}))
    assert_error(r, 413, path, type_="request_too_large")
    normal(hs)


@pytest.mark.parametrize("path", JSON_POSTS[:-1])
def test_prompt_characters_checked_before_tokenizing(hs, path):
    text = "a " * (MAX_CHARS // 2 + 1)            # under the byte limit, over the character one
    body = minimal(path)
    key = "prompt" if "prompt" in body else "input" if "input" in body else None
    if key:
        body[key] = text
    else:
        body["messages"][0]["content"] = text
    before = hs.state.prompt_cache.stats()["misses"] if hs.state.prompt_cache else None
    err = assert_error(post(hs, path, body), 413, path, type_="request_too_large")
    assert "--max-prompt-chars" in err["message"]
    if before is not None:      # refused before any prompt reached the engine
        assert hs.state.prompt_cache.stats()["misses"] == before
    normal(hs)


def test_slow_body_is_408(hs):
    def trickle():
        yield b'{"messages": ['
        time.sleep(2.0)
        yield b"]}"
    t0 = time.monotonic()
    r = httpx.post(hs.url + "/v1/chat/completions", content=trickle(), timeout=10,
                   headers=H(**{"content-type": "application/json"}))
    assert r.status_code == 408 and time.monotonic() - t0 < 2.0 + BOUND_S
    assert "did not arrive" in r.json()["error"]["message"]
    normal(hs)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_simple_request_content_types_are_415(hs, ctype):
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/adapters"):
        r = post(hs, path, content=json.dumps(minimal(path)).encode(),
                 headers=H(**{"content-type": ctype}))
        assert_error(r, 415, path)
    # admin routes need the JSON type; the generation routes take a bare body (scripts)
    r = post(hs, "/v1/adapters", content=b'{"path": "x"}', headers=H())
    assert_error(r, 415, "/v1/adapters")
    r = post(hs, "/v1/completions", content=json.dumps(minimal("/v1/completions")).encode(),
             headers=H())
    assert r.status_code == 200, r.text
    normal(hs)


def test_cors_per_route(hs):
    body = minimal("/v1/chat/completions")
    # an origin that is not granted: refused outright, admin and API routes alike
    for path in ("/v1/chat/completions", "/v1/adapters"):
        r = post(hs, path, body, headers=H(Origin=EVIL))
        assert_error(r, 403, path, type_="permission_error")
        assert "access-control-allow-origin" not in r.headers
    r = post(hs, "/v1/messages", minimal("/v1/messages"), headers=H(Origin=EVIL))
    assert_error(r, 403, "/v1/messages")
    # the granted origin: API routes with CORS headers, admin routes refused
    r = post(hs, "/v1/chat/completions", body, headers=H(Origin=GOOD))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    for method, path in (("GET", "/stats"), ("POST", "/v1/adapters"), ("GET", "/v1/adapters")):
        r = httpx.request(method, hs.url + path, headers=H(Origin=GOOD), json={"path": "x"})
        assert_error(r, 403, path, type_="permission_error")
    pre = {"Origin": GOOD, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(hs.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    assert_error(httpx.options(hs.url + "/v1/adapters", headers=pre), 403, "/v1/adapters")
    r = httpx.options(hs.url + "/v1/chat/completions", headers={**pre, "Origin": EVIL})
    assert_error(r, 403, "/v1/chat/completions")
    normal(hs)


def test_host_header_must_name_the_bind(hs):
    r = httpx.get(hs.url + "/v1/models", headers=H(Host="rebound.example:80"))
    assert_error(r, 403, "/v1/models", type_="permission_error")
    assert httpx.get(hs.url + "/v1/models", headers=H()).status_code == 200
    normal(hs)


def test_auth_everywhere_but_health(hs):
    assert httpx.get(hs.url + "/health").status_code == 200
    for method, path in OPERATIONS[1:]:
        r = httpx.request(method, hs.url + path, json={})
        assert_error(r, 401, path, type_="authentication_error")
        r = httpx.request(method, hs.url + path, json={}, headers={"x-api-key": KEY + "x"})
        assert_error(r, 401, path)
    normal(hs)


def test_405_has_allow(hs):
    for method, path in OPERATIONS:
        wrong = "PATCH" if method != "PATCH" else "PUT"
        r = httpx.request(wrong, hs.url + path, headers=H())
        assert_error(r, 405, path)
        allowed = {m.strip() for m in r.headers["allow"].split(",")}
        assert method in allowed, (path, allowed)
    r = httpx.request("PUT", hs.url + "/v1/adapters", headers=H())
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}
    normal(hs)


@pytest.mark.parametrize("body", [
    {"seed": -1}, {"seed": 2 ** 64}, {"seed": 2 ** 70}, {"seed": 1.5}, {"seed": "1"},
    {"temperature": 1e9}, {"temperature": -0.1}, {"top_p": 2}, {"presence_penalty": 5},
    {"frequency_penalty": -3}], ids=lambda b: json.dumps(b))
def test_sampling_ranges_are_400(hs, body):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
        if path == "/v1/messages" and "penalty" in next(iter(body)):
            continue
        r = post(hs, path, {**minimal(path), "temperature": 0.5, **body})
        err = assert_error(r, 400, path)
        assert next(iter(body)) in err["message"]
    normal(hs)


def test_seed_at_the_edges_of_the_range_is_served(hs):
    for seed in (0, 2 ** 64 - 1):
        r = post(hs, "/v1/chat/completions", {**minimal("/v1/chat/completions"),
                                                "seed": seed, "temperature": 0.7})
        assert r.status_code == 200, r.text


def _raw(hs, data: bytes) -> bytes:
    return raw_exchange(hs.url, data)


@pytest.mark.parametrize("name,data", [
    ("bad content-length", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Content-Length: abc\r\n\r\n{}"),
    ("bad chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"),
    ("5000 headers", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     + b"".join(b"X-H%d: v\r\n" % i for i in range(5000)) + b"\r\n"),
    ("1 MB header", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
                    + b"a" * (1 << 20) + b"\r\n\r\n"),
    ("garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_http_is_answered_in_json(hs, name, data):
    t0 = time.monotonic()
    out = _raw(hs, data)
    assert time.monotonic() - t0 < BOUND_S
    if name == "1 MB header" and not out:
        normal(hs)                    # closed at once, its answer lost to the reset
        return
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431" if name == "5000 headers" else b"HTTP/1.1 400"), \
        out[:200]
    assert b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    normal(hs)


def test_slowloris_headers_time_out(hs):
    host, port = hs.sock.getsockname()[:2]
    socks = []
    for _ in range(20):
        c = socket.create_connection((host, port))
        c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
        socks.append(c)
    t0 = time.monotonic()
    normal(hs)                       # served while the trickling sockets are held
    answers = []
    for c in socks:
        c.settimeout(5)
        answers.append(c.recv(4096))
        c.close()
    assert time.monotonic() - t0 < 1.0 + BOUND_S
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:2]


def _stream_text(hs, prompt, n, out):
    out.append(stream_chat_text(hs.url, prompt, n, headers=H(), logit_bias=EOS))


def test_innocent_stream_untouched_by_hostile_neighbours(hs):
    prompt = f"innocent {uuid.uuid4().hex[:6]}"
    solo = []
    _stream_text(hs, prompt, 48, solo)
    got = []
    t = threading.Thread(target=_stream_text, args=(hs, prompt, 48, got))
    t.start()
    deep = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for _ in range(3):
        post(hs, "/v1/chat/completions", content=deep,
             headers=H(**{"content-type": "application/json"}))
        post(hs, "/v1/messages", {**minimal("/v1/messages"), "seed": -1, "temperature": 0.5})
        post(hs, "/v1/completions", {"prompt": "a " * MAX_CHARS})
        _raw(hs, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Length: -5\r\n\r\n")
    t.join(60)
    assert got == solo and len(solo[0]) > 0


def test_adapter_mounts_are_confined(hs, roots, llama_dir):
    inside, outside = roots
    make_adapter(llama_dir, outside / "evil", seed=3)
    good = make_adapter(llama_dir, inside / "good", seed=4)
    (inside / "link").symlink_to(outside / "evil")
    refused = [{"path": "/root"}, {"path": "/nope/never"}, {"path": str(outside / "evil")},
               {"path": str(inside / ".." / "outside" / "evil")}, {"path": "../outside/evil"},
               {"path": "link"}, {"path": str(inside / "link")}, {"path": "~/.ssh"}]
    messages = set()
    for body in refused:
        err = assert_error(post(hs, "/v1/adapters", {"id": "x", **body}), 400, "/v1/adapters")
        messages.add(err["message"])
    assert len(messages) == 1                 # existing or not: the same answer
    assert str(inside) not in messages.pop()
    err = assert_error(post(hs, "/v1/adapters", {"id": "x", "path": "missing"}), 400,
                       "/v1/adapters")
    assert "does not exist" in err["message"] and str(inside) not in err["message"]
    r = post(hs, "/v1/adapters", {"id": "good", "path": "good"})
    assert r.status_code == 200 and r.json()["mounted_layers"] > 0, r.text
    assert httpx.delete(hs.url + "/v1/adapters/good", headers=H()).status_code == 200
    # over the size limit (4 MiB here): refused before loading
    huge = inside / "huge"
    huge.mkdir()
    (huge / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    with open(huge / "adapters.safetensors", "wb") as f:
        f.truncate(5 << 20)
    err = assert_error(post(hs, "/v1/adapters", {"id": "h", "path": "huge"}), 413,
                       "/v1/adapters", type_="request_too_large")
    assert "--max-adapter-mb" in err["message"]
    normal(hs)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                             max_size=4), max_leaves=12)
FIELDS = ["messages", "prompt", "input", "model", "max_tokens", "max_output_tokens", "seed",
          "temperature", "top_p", "top_k", "stop", "tools", "tool_choice", "stream", "n",
          "logit_bias", "system", "thinking", "response_format", "logprobs", "adapter"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(JSON_POSTS[:-1]),
       body=st.dictionaries(st.sampled_from(FIELDS), JSONISH, max_size=6))
def test_fuzzed_bodies_never_5xx(hs, path, body):
    body.setdefault("max_tokens", 2)
    for k in ("max_tokens", "max_output_tokens", "n"):     # keep valid lengths short
        if isinstance(body.get(k), int) and not isinstance(body[k], bool) and body[k] > 4:
            body[k] = 4
    r = post(hs, path, body, timeout=30)
    assert r.status_code < 500, (path, body, r.text[:300])
    if r.status_code >= 400:
        assert_error(r, r.status_code, path)


def test_scrub_hides_internals():
    from server.errors import scrub
    assert scrub("not found: GET /v1/nope") == "not found: GET /v1/nope"
    assert scrub(f"cannot read {os.path.expanduser('~')}/x/adapters.safetensors") == \
        "cannot read <path>"
    assert scrub("seed(): incompatible function arguments. The following argument types "
                 "are supported:\n    1. seed(seed: int) -> None") == "seed(): invalid argument"
    assert scrub("generation failed: TypeError: key(): incompatible function arguments. "
                 "The following") == "generation failed: key(): invalid argument"
    assert scrub("bad: json.decoder.JSONDecodeError: Expecting value") == "bad: Expecting value"


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


def _chars(v) -> int:
    if isinstance(v, str):
        return len(v)
    if isinstance(v, list):
        return sum(_chars(x) for x in v)
    if isinstance(v, dict):
        return sum(len(k) + _chars(x) for k, x in v.items())
    return 0


BRACKETY = st.text(alphabet='[]{}"\\ab,:', max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | BRACKETY,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(BRACKETY, kids, max_size=4),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(v=JSON_VALUES, indent=st.sampled_from([None, 1]))
def test_depth_and_characters_are_exact(v, indent):
    """The raw-byte depth scan equals the parsed depth (brackets and escaped quotes inside
    strings included), and the character count is every string and key."""
    from server.limits import json_depth, string_chars
    raw = json.dumps(v, indent=indent, ensure_ascii=False).encode()
    assert json_depth(raw) == _depth(v)
    assert string_chars(v) == _chars(v)


def test_cors_star_never_grants_admin_unless_asked():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient
    from server.security import SecurityConfig, add_security_middleware

    def ok(request):
        return PlainTextResponse("ok")

    routes = [Route(p, ok, methods=["GET"]) for p in ("/v1/models", "/stats", "/v1/adapters")]
    for admin_too in (False, True):
        app = Starlette(routes=routes)
        add_security_middleware(app, SecurityConfig(cors_origins=("*",), cors_admin=admin_too))
        c = TestClient(app, base_url="http://127.0.0.1")
        r = c.get("/v1/models", headers={"Origin": EVIL})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        for path in ("/stats", "/v1/adapters"):
            r = c.get(path, headers={"Origin": EVIL})
            assert r.status_code == (200 if admin_too else 403), (path, admin_too)
        assert c.get("/stats").status_code == 200          # no Origin: not a browser
