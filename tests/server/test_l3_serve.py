"""engine-serve --tier l3: every batch row decodes on the fast runner (--tier l3 defaults to
--batch 32; with --batch 1 each request is one fast row), /stats says so (levers.lanes, the
fast step's counters); the removed --fast-batch flag is refused."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.levers import resolve
from server.cli import config_from_args, parser
from srv_helpers import start_server, stop_server


@pytest.fixture(scope="module")
def l3(llama_dir):
    s = start_server(llama_dir, levers=resolve("l3", env={}), temperature=0.0,
                     prompt_cache_bytes=64 << 20, batch=1)   # `engine-serve --tier l3 --batch 1`
    yield s
    stop_server(s)


def _chat(s, content, n=12, stream=False):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": n, "stream": stream}
    r = httpx.post(s.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_l3_serves_and_reports_its_levers(l3):
    """--batch 1 at l3: each request is a batch row (not a solo one) on the fast runner."""
    msgs = [{"role": "user", "content": "count to ten"}]
    text = _chat(l3, "count to ten").json()["choices"][0]["message"]["content"]
    again = _chat(l3, "count to ten").json()["choices"][0]["message"]["content"]  # cache hit
    streamed = _chat(l3, "count to ten", stream=True).text
    assert text == again and text
    assert '"content"' in streamed
    lv = httpx.get(l3.url + "/stats").json()["levers"]
    assert lv["tier"] == "l3" and lv["compiled_decode"] and lv["perf_kernel"]
    assert lv["fast_decode"] is True and lv["fast_stats"]["steps"] >= 3 * 11
    assert lv["lanes"] == {"solo": "fast", "batch": "fast"}
    st = httpx.get(l3.url + "/stats").json()["batch"]
    assert st["batched"] is True and st["lanes"] == {"batch": 3, "serial": 0}
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


def test_batched_l3_server_decodes_rows_on_the_fast_runner(llama_dir):
    s = start_server(llama_dir, levers=resolve("l3", env={}), temperature=0.0,
                     prompt_cache_bytes=0, batch=4)
    try:
        before = httpx.get(s.url + "/stats").json()["levers"].get("fast_stats", {}).get("steps", 0)
        text = _chat(s, "count to ten").json()["choices"][0]["message"]["content"]
        st = httpx.get(s.url + "/stats").json()
        assert st["levers"]["lanes"] == {"solo": "fast", "batch": "fast"}
        assert st["batch"]["lanes"] == {"batch": 1, "serial": 0}
        assert st["levers"]["fast_stats"]["steps"] >= before + 11
        assert st["levers"]["fast_stats"]["row_steps"] >= 11
        ref = s.generate([{"role": "user", "content": "count to ten"}], max_tokens=12,
                         temperature=0.0)
        assert ref.text == text
    finally:
        stop_server(s)


def test_cli_tier_flags(monkeypatch):
    monkeypatch.delenv("MLXP_TIER", raising=False)
    cfg = config_from_args(parser().parse_args(["--l3", "--no-perf-kernel"]))
    assert cfg.levers.tier == "l3" and not cfg.levers.perf_kernel and cfg.levers.compiled_decode
    assert cfg.batch == 32                     # the fast runner takes any number of rows
    assert config_from_args(parser().parse_args(["--l3", "--batch", "4"])).batch == 4
    assert config_from_args(parser().parse_args(["--l3", "--batch", "1"])).batch == 1
    assert config_from_args(parser().parse_args(["--compiled-decode"])).batch == 32
    assert config_from_args(parser().parse_args([])).batch == 32
    assert config_from_args(parser().parse_args(["--l1"])).batch == 32
    monkeypatch.setenv("MLXP_COMPILED_DECODE", "perhaps")
    with pytest.raises(SystemExit, match="MLXP_COMPILED_DECODE"):
        config_from_args(parser().parse_args([]))


def test_l3_server_answers_concurrent_requests_on_the_fast_runner(llama_dir):
    """`engine-serve --tier l3 --batch 4`: concurrent requests run as rows of the batch,
    decoded by the fast step; on the CPU that step is exact, so each answer is the one the
    same request gets alone."""
    s = start_server(llama_dir, levers=resolve("l3", env={}), temperature=0.0,
                     prompt_cache_bytes=0, batch=4)
    try:
        prompts = ["count to ten", "say hello", "name three colours", "write a haiku"]
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: _chat(s, p).json()["choices"][0]["message"]["content"],
                                  prompts))
        st = httpx.get(s.url + "/stats").json()
        lv = st["levers"]
        assert lv["lanes"] == {"solo": "fast", "batch": "fast"}
        assert st["batch"]["lanes"] == {"batch": 4, "serial": 0}
        assert "fast_batch_stats" not in lv and "fast_batch" not in lv
        fs = lv["fast_stats"]
        assert fs["row_steps"] >= 4 * 11 and fs["traces"] >= 1 and fs["steps"] >= 11
        for p, text in zip(prompts, texts):
            ref = s.generate([{"role": "user", "content": p}], max_tokens=12, temperature=0.0)
            assert ref.text == text
    finally:
        stop_server(s)


def test_cli_refuses_the_removed_fast_batch_flag(monkeypatch, capsys):
    """--fast-batch is gone (the fast runner takes every row): argparse refuses it by name."""
    monkeypatch.delenv("MLXP_TIER", raising=False)
    for argv in (["--l3", "--fast-batch"], ["--fast-batch"], ["--l3", "--no-fast-batch"]):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(argv)
        assert e.value.code == 2
        assert argv[-1] in capsys.readouterr().err
    cfg = config_from_args(parser().parse_args(["--l3"]))
    assert not hasattr(cfg.levers, "fast_batch") and cfg.batch == 32
