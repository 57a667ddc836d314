"""Security defaults of `engine-serve` as a user starts it (subprocesses): the API key,
the ready line, the bind warning, bounded shutdown, default CORS and limits."""

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from test_cli import spawn, wait_ready

EOS = {"1009": -100, "1016": -100, "1017": -100}


def test_empty_api_key_is_refused_at_start():
    p = spawn("--port", "0", "--api-key", "  ")
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "--api-key is empty" in err and "ready" not in out


@pytest.mark.parametrize("flag", [["--max-json-depth", "0"], ["--max-body-mb", "-1"],
                                  ["--header-timeout", "0"], ["--max-prompt-chars", "-5"]])
def test_bad_limit_flags_are_refused(flag):
    p = spawn("--port", "0", *flag)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and flag[0] in err


def _stream(url, out):
    body = {"prompt": "tell me everything", "max_tokens": 20000, "stream": True,
            "logit_bias": EOS}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out.append(line)
    except httpx.HTTPError as e:
        out.append(repr(e))


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_defaults_and_bounded_shutdown(llama_dir, tmp_path):
    """No key: the ready line says auth=off; no origin is granted; the prompt-character
    limit is 16 x the model's context; SIGTERM with a long stream running exits within
    --shutdown-timeout (+ teardown)."""
    p = spawn("--model", str(llama_dir), "--port", "0", "--shutdown-timeout", "1",
              "--prompt-cache", "0", "--adapter-dir", str(tmp_path))
    try:
        m, line = wait_ready(p)
        url = m.group(1)
        assert line.rstrip().endswith("auth=off")
        r = httpx.post(url + "/v1/completions", headers={"Origin": "http://page.example"},
                       json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        over = 16 * 131072 + 1                   # llama fixture: 131,072 positions
        r = httpx.post(url + "/v1/completions", json={"prompt": "a" * over, "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 413 and "--max-prompt-chars" in r.json()["error"]["message"]
        # 15M characters in a chat body (under --max-body-mb): refused by the guard before
        # the request model, the chat template or the tokenizer see it (tokenizing first
        # peaked at ~250 bytes of RSS per prompt byte: 3.7 GB here)
        before = _peak_rss(p.pid)
        big = {"messages": [{"role": "user", "content": "a" * 15_000_000}], "max_tokens": 1}
        r = httpx.post(url + "/v1/chat/completions", json=big, timeout=60)
        assert r.status_code == 413 and "--max-prompt-chars" in r.json()["error"]["message"]
        assert _peak_rss(p.pid) - before < 256 << 20, (before, _peak_rss(p.pid))
        r = httpx.post(url + "/v1/adapters", json={"path": "/root"})
        assert r.status_code == 400 and "--adapter-dir" in r.json()["error"]["message"]
        got = []
        t = threading.Thread(target=_stream, args=(url, got), daemon=True)
        t.start()
        t0 = time.monotonic()
        while len(got) < 3 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert len(got) >= 3, got
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=20)
    assert took < 1 + 6, took       # without the bound it waits for all 20,000 tokens


def test_key_in_ready_line_and_public_bind_warning():
    p = spawn("--port", "0", "--host", "0.0.0.0", "--prompt-cache", "0")
    try:
        m, line = wait_ready(p)
        assert line.rstrip().endswith("auth=off")
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert "without --api-key" in err
    p = spawn("--port", "0", "--api-key", "k", "--prompt-cache", "0")
    try:
        m, line = wait_ready(p)
        assert line.rstrip().endswith("auth=on")
        assert httpx.get(m.group(1) + "/v1/models").status_code == 401
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert "without --api-key" not in err


def test_prompt_char_default_follows_the_model(llama_dir):
    from server.app import create_app, security_for
    from server.state import ServerConfig

    class FakeState:
        config = ServerConfig(model=str(llama_dir))
        max_position = 4096

    app = create_app(FakeState())
    assert app.state.security.limits.max_prompt_chars == 16 * 4096
    assert app.state.security.cors_origins == ()
    assert app.state.security.allowed_hosts == ("localhost", "127.0.0.1", "::1")
    sec = security_for(ServerConfig(host="0.0.0.0"))
    assert sec.allowed_hosts is None and sec.adapter_dirs == ("~/.cache/mlx-parity/adapters",)
    json.dumps(sec.limits.__dict__)


def test_sigterm_answers_every_request_before_exit(llama_dir, tmp_path):
    """SIGTERM with one stream running and one request queued behind it (--batch 1): the
    queued request is answered 503 at once, the stream gets --shutdown-timeout seconds and then
    a final error event (not a cut connection), and the server exits."""
    p = spawn("--model", str(llama_dir), "--port", "0", "--shutdown-timeout", "1",
              "--batch", "1", "--prompt-cache", "0", "--adapter-dir", str(tmp_path))
    lines, queued, ended = [], {}, {}
    try:
        m, _ = wait_ready(p)
        url = m.group(1)

        def stream():
            body = {"model": "m", "max_tokens": 20000, "stream": True,
                    "messages": [{"role": "user", "content": "tell me everything"}]}
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                                  json={**body, "logit_bias": EOS}) as r:
                    lines.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))
            except httpx.HTTPError as e:
                lines.append(repr(e))
            ended["at"] = time.monotonic()

        def waiting():
            body = {"model": "m", "max_tokens": 4, "system": "s",
                    "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(url + "/v1/messages", json=body, timeout=60)
            queued.update(status=r.status_code, body=r.json(), at=time.monotonic())

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        t0 = time.monotonic()
        while len(lines) < 3 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        q = threading.Thread(target=waiting, daemon=True)
        q.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:          # the second request is inside, queued
            st = httpx.get(url + "/stats", timeout=5).json()
            if st["queue"]["queued"] >= 1:
                break
            time.sleep(0.05)
        assert st["queue"]["queued"] >= 1, st["queue"]
        p.send_signal(signal.SIGTERM)
        q.join(20)
        t.join(20)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=20)
    assert queued["status"] == 503, queued
    assert queued["body"]["type"] == "error" and queued["body"]["error"]["type"] == "overloaded_error"
    assert "shutting down" in queued["body"]["error"]["message"]
    assert queued["at"] < ended["at"]          # at once, not after the running one's grace
    assert len(lines) >= 3, lines
    last = [ln for ln in lines if ln != "data: [DONE]"][-1]
    err = json.loads(last[len("data: "):])
    assert "shutting down" in err["error"]["message"], lines[-3:]
