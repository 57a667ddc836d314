"""Edges of who may talk to the server (no model: the security middleware on a bare app).

- Bound beyond loopback without a key, a DNS-rebound page (`Host: evil.example:P` with the
  matching `Origin`) is refused, while IP literals, loopback and this machine's names pass.
- An empty `x-api-key:` header beside a valid Bearer token is no key, not a wrong one.
- The chat page carries a CSP that admits exactly its own inline script and style, no framing,
  no sniffing; the API key lives in sessionStorage, not localStorage.
- /v1/models and /stats show no filesystem paths.
"""
import base64
import hashlib
import re

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from server.security import SecurityConfig, add_security_middleware, machine_names

EVIL = "evil.example:8090"


def _client(**cfg):
    def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok, methods=["GET"]) for p in ("/v1/models", "/stats")])
    add_security_middleware(app, SecurityConfig(**cfg))
    return TestClient(app, base_url="http://127.0.0.1")


@pytest.mark.parametrize("path", ["/stats", "/v1/models"])
def test_rebound_host_refused_on_a_public_bind_without_key(path):
    c = _client()                                  # allowed_hosts None: bound beyond loopback
    r = c.get(path, headers={"Host": EVIL, "Origin": "http://" + EVIL})
    assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
    r = c.get(path, headers={"Host": EVIL})
    assert r.status_code == 403
    for host in ("192.168.1.7:8090", "[::1]:8090", "localhost:8090", "10.0.0.2",
                 sorted(machine_names())[0]):
        assert c.get(path, headers={"Host": host}).status_code == 200, host
    # a same-origin page on an IP address still works
    r = c.get(path, headers={"Host": "192.168.1.7:8090", "Origin": "http://192.168.1.7:8090"})
    assert r.status_code == 200


def test_named_hosts_and_keys_lift_the_rebinding_guard():
    assert _client(allowed_hosts=("evil.example",)).get(
        "/stats", headers={"Host": EVIL}).status_code == 200
    c = _client(api_key="k")
    assert c.get("/stats", headers={"Host": EVIL, "x-api-key": "k"}).status_code == 200


def test_empty_x_api_key_beside_a_valid_bearer_is_served():
    c = _client(api_key="k", allowed_hosts=("*",))
    assert c.get("/stats", headers={"x-api-key": "", "Authorization": "Bearer k"}).status_code == 200
    assert c.get("/stats", headers={"x-api-key": "", "Authorization": "Bearer x"}).status_code == 401
    assert c.get("/stats", headers={"x-api-key": "x", "Authorization": "Bearer k"}).status_code == 401
    assert c.get("/stats", headers={"x-api-key": ""}).status_code == 401


def test_chat_page_headers_admit_only_its_own_script():
    from server.chat_page import page, page_headers

    h = page_headers()
    assert h["X-Frame-Options"] == "DENY" and h["X-Content-Type-Options"] == "nosniff"
    csp = h["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    script = re.search(r"<script>(.*?)</script>", page(), re.S).group(1)
    want = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{want}'" in csp
    assert "connect-src 'self'" in csp
    assert "localStorage" not in page() and "sessionStorage" in page()


def test_models_and_stats_show_no_paths(llama_dir):
    from server.app import create_app
    from server.state import ServerConfig, build_state

    state = build_state(ServerConfig(model=str(llama_dir), max_tokens=4))
    try:
        c = TestClient(create_app(state, SecurityConfig(allowed_hosts=("*",))))
        models, stats = c.get("/v1/models"), c.get("/stats")
        assert models.status_code == 200 and stats.status_code == 200
        text = models.text + stats.text
        assert str(llama_dir) not in text and str(llama_dir.parent) not in text
    finally:
        state.gateway.close()
