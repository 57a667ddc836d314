"""`engine-serve` as a user starts it (a subprocess): ready line, defaults, flags."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.cli import config_from_args, parser
from srv_helpers import wait_ready_line

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"engine-serve ready: (http://[\d.]+:\d+) model=(\S+) "
                   r"admission ceiling=(\d+) tokens")


def spawn(*args, **env_extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **env_extra}
    return subprocess.Popen([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(p, timeout=90):
    return wait_ready_line(p, READY, timeout)


def test_default_model_ready_line_batch_warning_and_auth():
    from engine.cli import default_model_dir
    p = spawn("--port", "0", "--batch", "4", "--api-key", "k1", "--temp", "0",
              "--memory-budget", "2", "--prompt-cache", "0")
    try:
        m, line = wait_ready(p)
        url, model_id, ceiling = m.group(1), m.group(2), int(m.group(3))
        assert model_id == Path(default_model_dir()).name
        assert ceiling > 0 and "2.00 GB budget" in line
        # the model's context beside the ceiling (the built-in model's is 4096 tokens)
        assert f"admission ceiling={ceiling} tokens of the model's 4096-token context (" in line
        assert httpx.get(url + "/health").content == b'{"status": "ok"}'
        assert httpx.get(url + "/stats").status_code == 401
        s = httpx.get(url + "/stats", headers={"x-api-key": "k1"}).json()
        assert s["batch"]["configured"] == 4 and s["batch"]["batched"] is True
        assert s["batch"]["active_rows"] == 0
        assert s["admission"]["max_safe_context"] == ceiling
        assert s["admission"]["memory_budget_bytes"] == 2_000_000_000
        assert s["prompt_cache"]["max_bytes"] == 0
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer k1"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        p.terminate()
        _, err = p.communicate(timeout=20)
    assert "not available" not in err


def test_busy_port_is_refused_before_loading():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        p = spawn("--port", str(port))
        out, err = p.communicate(timeout=60)
    finally:
        s.close()
    assert p.returncode != 0 and "already in use" in err


def test_bad_model_dir_is_a_clear_error(tmp_path):
    p = spawn("--port", "0", "--model", str(tmp_path))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "cannot start" in err and "Traceback" not in err


def test_flag_units_and_aliases():
    c = config_from_args(parser().parse_args(
        ["--memory-budget", "1.5", "--prompt-cache", "0.5", "--temp", "0.3",
         "--adapter-path", "/x", "--decode-concurrency", "3", "--kv-bits", "8",
         "--thinking", "false", "--chat-template-args", '{"a": 1}']))
    assert c.memory_budget_bytes == 1_500_000_000          # decimal GB
    assert c.prompt_cache_bytes == 1 << 29                  # binary GiB
    assert c.temperature == 0.3 and c.adapter == "/x" and c.batch == 3
    assert c.kv_quant == "8" and c.thinking is False and c.template_kwargs == {"a": 1}
    d = config_from_args(parser().parse_args([]))
    assert (d.host, d.port, d.kv_quant, d.prompt_cache_bytes, d.batch) == (
        "127.0.0.1", 8090, "config", None, 32)           # None: a share of the budget
    assert config_from_args(parser().parse_args(["--prompt-cache-bytes", "123"])) \
        .prompt_cache_bytes == 123
    with pytest.raises(SystemExit):
        parser().parse_args(["--thinking", "maybe"])


@pytest.mark.parametrize("flags,want", [
    (["--memory-budget", "3"], "share"), (["--memory-budget", "40"], "share"),
    (["--memory-budget", "3", "--prompt-cache-bytes", "123"], 123),
    (["--memory-budget", "3", "--prompt-cache", "0.5"], 1 << 29),
    (["--memory-budget", "3", "--prompt-cache", "0"], 0)])
def test_prompt_cache_default_follows_the_memory_budget(qwen_dir, flags, want):
    """Default cap: PROMPT_CACHE_FRACTION of the admission budget left after the weights
    (0.2.10: a fixed 2e9 bytes, less than one 16K-token prefix of an 8B model); an
    explicit size is kept as given, 0 turns the cache off."""
    from engine.step.admission import PROMPT_CACHE_FRACTION
    from server.state import build_state
    cfg = config_from_args(parser().parse_args(["--model", str(qwen_dir), *flags]))
    state = build_state(cfg)
    try:
        got = state.prompt_cache.max_bytes if state.prompt_cache is not None else 0
        adm = state.admission
        if want == "share":
            want = int((adm.budget_bytes - adm.weights) * PROMPT_CACHE_FRACTION)
            assert want == adm.prompt_cache_bytes() and 0 < want < adm.budget_bytes // 4
        assert got == want == state.stats()["prompt_cache"]["max_bytes"]
    finally:
        state.gateway.close()


def test_accepted_connections_are_nodelay_and_quickack():
    """Small SSE writes must not wait behind Nagle / delayed ACKs (a 40 ms TTFT stall on
    keep-alive connections): the listening socket says it is TCP, so asyncio sets
    TCP_NODELAY on every accepted connection, and the protocol is the quick-ACK one."""
    from fastapi import FastAPI
    from server.cli import BackgroundServer, bind

    s = bind("127.0.0.1", 0)
    assert s.proto == socket.IPPROTO_TCP
    s.close()
    with BackgroundServer(FastAPI()) as bg:
        c = socket.create_connection(bg.sock.getsockname()[:2])
        c.sendall(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 404")
        (proto,) = bg.server.server_state.connections
        assert type(proto).__name__ == "QuickAckH11Protocol"
        sock = proto.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        c.close()
