"""engine-serve --deterministic (issue #41): /stats shows the mode; concurrent requests get the
logprobs they get alone; the flag is refused with the fast runner (one line, no traceback)."""

import threading

import httpx
import pytest

from server.cli import config_from_args, parser
from starter.models import ensure_fixture
from tests.server.srv_helpers import start_server, stop_server


def test_refused_with_tier_l3():
    with pytest.raises(SystemExit, match="engine-serve: --deterministic does not run with the "
                                         "fast runner"):
        config_from_args(parser().parse_args(["--deterministic", "--tier", "l3"]))
    assert config_from_args(parser().parse_args(["--deterministic"])).deterministic is True
    assert config_from_args(parser().parse_args([])).deterministic is False


def _complete(url, prompt, n):
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]


@pytest.mark.parametrize("deterministic", [True, False])
def test_stats_shows_the_mode_and_crowded_requests_match_alone(deterministic):
    path = ensure_fixture("gemma3_text")
    s = start_server(path, deterministic=deterministic, batch=8, prompt_cache_bytes=0,
                     kv_quant="off")
    try:
        assert httpx.get(s.url + "/stats").json()["deterministic"] is deterministic
        if not deterministic:
            return
        target = " ".join(f"w{i}" for i in range(30))
        alone = _complete(s.url, target, 12)
        crowd = [f"filler {i} " + "x " * (3 * i) for i in range(6)]
        got = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, _complete(
            s.url, p, 4 + 2 * len(p) % 20))) for p in crowd]
        for t in threads:
            t.start()
        again = _complete(s.url, target, 12)
        for t in threads:
            t.join()
        assert len(got) == len(crowd)
        assert again == alone       # text, logprobs and top logprobs, float for float
        assert httpx.get(s.url + "/stats").json()["batch"]["peak_rows"] > 1
    finally:
        stop_server(s)


def test_an_adapter_request_is_a_400_where_the_gpu_kernels_run(llama_dir, tmp_path, monkeypatch):
    """On CUDA deterministic mode has no batch-invariant form of the adapters' low-rank
    matmuls: the request is refused with the reason (a 400, nothing generated), and the same
    server still answers without the adapter. (CUDA is simulated: the refusal's switch.)"""
    from engine import deterministic
    from tests.server.srv_helpers import make_adapter
    s = start_server(llama_dir, deterministic=True, batch=4, prompt_cache_bytes=0)
    try:
        path = make_adapter(llama_dir, tmp_path / "A", seed=1)
        r = httpx.post(s.v1 + "/adapters", json={"id": "A", "path": str(path)})
        assert r.status_code == 200, r.text
        monkeypatch.setattr(deterministic, "refuses_adapters", lambda: True)
        body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
        r = httpx.post(s.v1 + "/completions", json={**body, "adapter": "A"}, timeout=60)
        assert r.status_code == 400, r.text
        assert "does not run adapters" in r.json()["error"]["message"]
        assert httpx.post(s.v1 + "/completions", json=body, timeout=60).status_code == 200
    finally:
        stop_server(s)
