"""engine-serve --tier l3: the solo lane decodes through the fast step (--tier l3 defaults to
--batch 1), /stats says so; with --batch N the batched rows stay L1, unless --fast-batch."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.levers import parse_spec, resolve
from server.cli import config_from_args, parser
from srv_helpers import start_server, stop_server


@pytest.fixture(scope="module")
def l3(llama_dir):
    s = start_server(llama_dir, levers=resolve("l3", env={}), temperature=0.0,
                     prompt_cache_bytes=64 << 20, batch=1)   # as `engine-serve --tier l3`
    yield s
    stop_server(s)


def _chat(s, content, n=12, stream=False):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": n, "stream": stream}
    r = httpx.post(s.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_l3_serves_and_reports_its_levers(l3):
    msgs = [{"role": "user", "content": "count to ten"}]
    text = _chat(l3, "count to ten").json()["choices"][0]["message"]["content"]
    again = _chat(l3, "count to ten").json()["choices"][0]["message"]["content"]  # cache hit
    streamed = _chat(l3, "count to ten", stream=True).text
    assert text == again and text
    assert '"content"' in streamed
    lv = httpx.get(l3.url + "/stats").json()["levers"]
    assert lv["tier"] == "l3" and lv["compiled_decode"] and lv["perf_kernel"]
    assert lv["fast_decode"] is True and lv["fast_stats"]["steps"] >= 3 * 11
    assert lv["lanes"] == {"solo": "fast", "batch": "off"}
    # on the CPU the fast step is exact: the same text as the token loop without it (in
    # process, same model; its merged projections are exact too, tests/parity/test_levers_l1)
    ref = l3.generate(msgs, max_tokens=12, temperature=0.0)
    assert ref.text == text


def test_default_server_reports_l1(aux_l1):
    lv = httpx.get(aux_l1.url + "/stats").json()["levers"]
    assert lv["tier"] == "l1" and not lv["compiled_decode"] and "fast_stats" not in lv


@pytest.fixture(scope="module")
def aux_l1(llama_dir):
    s = start_server(llama_dir, prompt_cache_bytes=0)
    yield s
    stop_server(s)


def test_batched_l3_server_keeps_rows_on_l1(llama_dir):
    s = start_server(llama_dir, levers=resolve("l3", env={}), temperature=0.0,
                     prompt_cache_bytes=0, batch=4)
    try:
        before = httpx.get(s.url + "/stats").json()["levers"].get("fast_stats", {}).get("steps", 0)
        text = _chat(s, "count to ten").json()["choices"][0]["message"]["content"]
        st = httpx.get(s.url + "/stats").json()
        assert st["levers"]["lanes"]["batch"] == "l1" and st["batch"]["lanes"]["batch"] == 1
        assert st["levers"].get("fast_stats", {}).get("steps", 0) == before
        ref = s.generate([{"role": "user", "content": "count to ten"}], max_tokens=12,
                         temperature=0.0)
        assert ref.text == text
    finally:
        stop_server(s)


def test_cli_tier_flags(monkeypatch):
    monkeypatch.delenv("MLXP_TIER", raising=False)
    cfg = config_from_args(parser().parse_args(["--l3", "--no-perf-kernel"]))
    assert cfg.levers.tier == "l3" and not cfg.levers.perf_kernel and cfg.levers.compiled_decode
    assert cfg.batch == 1                      # the fast step is the solo lane's
    assert config_from_args(parser().parse_args(["--l3", "--batch", "4"])).batch == 4
    assert config_from_args(parser().parse_args([])).batch == 8
    monkeypatch.setenv("MLXP_COMPILED_DECODE", "perhaps")
    with pytest.raises(SystemExit, match="MLXP_COMPILED_DECODE"):
        config_from_args(parser().parse_args([]))


def test_fast_batch_server_answers_concurrent_requests_on_the_fast_step(llama_dir):
    """`engine-serve --tier l3 --fast-batch --batch 4`: concurrent requests run as rows of
    the batch, decoded by the batch fast step; on the CPU that step is exact, so each
    answer is the one the same request gets alone."""
    s = start_server(llama_dir, levers=parse_spec("l3+fast_batch"), temperature=0.0,
                     prompt_cache_bytes=0, batch=4)
    try:
        prompts = ["count to ten", "say hello", "name three colours", "write a haiku"]
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: _chat(s, p).json()["choices"][0]["message"]["content"],
                                  prompts))
        st = httpx.get(s.url + "/stats").json()
        lv = st["levers"]
        assert lv["lanes"] == {"solo": "fast", "batch": "fast"}
        assert st["batch"]["lanes"]["batch"] == 4
        fb = lv["fast_batch_stats"]
        assert fb["row_steps"] >= 4 * 11 and fb["fallbacks"] == 0 and fb["traces"] >= 1
        for p, text in zip(prompts, texts):
            ref = s.generate([{"role": "user", "content": p}], max_tokens=12, temperature=0.0)
            assert ref.text == text
    finally:
        stop_server(s)


def test_cli_fast_batch_keeps_batching(monkeypatch):
    monkeypatch.delenv("MLXP_TIER", raising=False)
    monkeypatch.delenv("MLXP_FAST_BATCH", raising=False)
    cfg = config_from_args(parser().parse_args(["--l3", "--fast-batch"]))
    assert cfg.levers.fast_batch_decode and cfg.batch == 8
    cfg = config_from_args(parser().parse_args(["--l3", "--fast-batch", "--batch", "8"]))
    assert cfg.batch == 8 and cfg.levers.fast_batch
    assert not config_from_args(parser().parse_args(["--l3"])).levers.fast_batch
