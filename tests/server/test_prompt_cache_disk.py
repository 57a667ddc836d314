"""engine-serve --prompt-cache-dir: a prefix written by one server is read back by the
next one started on the same directory (both lanes); /stats counts the bytes written
per request and the restores; bad flag values are CLI errors."""

from __future__ import annotations

import httpx
import pytest

from server.cli import config_from_args, parser

from srv_helpers import start_server, stop_server

SYSTEM = "You are a careful coding agent. " * 40


def _ask(url: str, text: str) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            "max_tokens": 3, "temperature": 0.0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _disk(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()["prompt_cache"]["disk"]


@pytest.mark.parametrize("batch", [1, 8])
def test_restart_reads_the_prefix_back(qwen_dir, tmp_path, batch):
    s = start_server(qwen_dir, batch=batch, prompt_cache_dir=str(tmp_path))
    try:
        first = _ask(s.url, "hello")
        s.state.engine.disk_cache.flush()
        d = _disk(s.url)
        assert d["enabled"] and d["writes"] == 1 and d["files"] == 1
        assert d["bytes_written"] == d["last_write_bytes"] == d["bytes"] > 0
    finally:
        stop_server(s)
    s = start_server(qwen_dir, batch=batch, prompt_cache_dir=str(tmp_path))
    try:
        assert _disk(s.url)["files"] == 1          # indexed at start, nothing read yet
        again = _ask(s.url, "hello again")
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0.95 * first["usage"]["prompt_tokens"]     # the system prompt, at least
        d = _disk(s.url)
        assert d["hits"] == 1 and d["tokens_restored"] == cached and d["bytes_read"] > 0
        assert d["last_restore_ms"] > 0
        m = httpx.get(s.url + "/metrics", timeout=10).text
        assert "engine_prompt_cache_disk_hits_total 1.0" in m
        assert f"engine_prompt_cache_disk_files {d['files']}.0" in m
    finally:
        stop_server(s)


def test_without_the_flag_there_is_no_disk_cache(srv):
    assert _disk(srv.url) == {"enabled": False}


def test_flags(tmp_path):
    c = config_from_args(parser().parse_args(
        ["--prompt-cache-dir", str(tmp_path / "pc"), "--prompt-cache-disk-gb", "1.5"]))
    assert c.prompt_cache_dir == str(tmp_path / "pc") and c.prompt_cache_disk_gb == 1.5
    assert (tmp_path / "pc").is_dir()
    for gb in ("0", "-1", "nan", "inf", "1e400"):   # (inf overflowed after the model loaded)
        with pytest.raises(SystemExit, match="must be a finite number > 0"):
            config_from_args(parser().parse_args(["--prompt-cache-disk-gb", gb]))
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="--prompt-cache-dir"):
        config_from_args(parser().parse_args(["--prompt-cache-dir", str(tmp_path / "file")]))
    with pytest.raises(SystemExit, match="is empty"):     # (was the cwd, then silently off)
        config_from_args(parser().parse_args(["--prompt-cache-dir", " "]))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SystemExit, match="broken symbolic link"):
        config_from_args(parser().parse_args(["--prompt-cache-dir", str(tmp_path / "dangling")]))


def test_a_directory_another_server_uses_is_refused_before_the_model_loads(tmp_path, hold_dir):
    d = tmp_path / "shared"
    holder = hold_dir(d)
    with pytest.raises(SystemExit, match=f"in use by another process \\(pid {holder.pid}\\)"):
        config_from_args(parser().parse_args(["--prompt-cache-dir", str(d)]))
    holder.kill()
    holder.wait()
    assert config_from_args(parser().parse_args(["--prompt-cache-dir", str(d)])).prompt_cache_dir


SLOW_WRITE = '''
import time
import engine.kv.disk_cache as dc
_write = dc.write_file
def _slow(*a, **k):
    time.sleep(1.5)
    return _write(*a, **k)
dc.write_file = _slow
'''


def _slow_writing_server(qwen_dir, tmp_path):
    """engine-serve as a user runs it (a subprocess) on a cache directory, each file's write
    slowed to 1.5 s (a sitecustomize on its path); (the process, the directory)."""
    import os
    from test_cli import ROOT, spawn
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WRITE)
    cache = tmp_path / "cache"
    return spawn("--model", str(qwen_dir), "--port", "0", "--prompt-cache-dir", str(cache),
                 PYTHONPATH=f"{ROOT}{os.pathsep}{site}"), cache


def test_sigterm_finishes_the_pending_file_before_exit(qwen_dir, tmp_path):
    """engine-serve as a user runs it (a subprocess), its file's write slowed to 1.5 s, gets
    SIGTERM right after the answer: it exits 0 once the file is complete, and the next server
    reads it back. (uvicorn raises the signal again after its graceful shutdown: the default
    handler killed the process there, before the cache's flush: no file, or half of one.)"""
    import signal
    from test_cli import wait_ready
    p, cache = _slow_writing_server(qwen_dir, tmp_path)
    try:
        m, _ = wait_ready(p)
        first = _ask(m.group(1), "hello")
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=20)
    assert p.returncode == 0
    assert [f.suffix for f in cache.iterdir() if f.name != ".lock"] == [".safetensors"]
    s = start_server(qwen_dir, prompt_cache_dir=str(cache))
    try:
        again = _ask(s.url, "hello again")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.95 * first["usage"]["prompt_tokens"]
        assert _disk(s.url)["hits"] == 1
    finally:
        stop_server(s)


def test_a_second_sigterm_while_finishing_the_file_ends_at_once_without_a_traceback(
        qwen_dir, tmp_path):
    """SIGTERM, then another one while the pending file (its write slowed to 1.5 s) is being
    finished: the process ends at once, as a signal's default does (no exception raised inside
    the clean-up, no traceback), and the next start finds no half-written file to use."""
    import signal
    import time
    from test_cli import wait_ready
    p, cache = _slow_writing_server(qwen_dir, tmp_path)
    try:
        m, _ = wait_ready(p)
        _ask(m.group(1), "hello")
        p.send_signal(signal.SIGTERM)
        time.sleep(0.7)             # (inside the 1.5 s write)
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        p.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
        _, err = p.communicate(timeout=20)
    assert p.returncode == -signal.SIGTERM and took < 1.0, (p.returncode, took)
    assert "Traceback" not in err, err[-2000:]
    s = start_server(qwen_dir, prompt_cache_dir=str(cache))
    try:
        assert _disk(s.url)["files"] == 0
    finally:
        stop_server(s)


def test_a_restarted_server_has_encoded_the_stored_prefix_text(qwen_dir, tmp_path):
    """The warm-up also encodes the text of the longest stored prefix, so a restarted
    server's first turn tokenizes only its new part (a ~25K-token conversation: ~56 ms for the
    whole text in a fresh process on the 2-core CPU, ~2.5 ms for a new turn), its ids those of
    encoding the whole text. Control: `--warm-up-tokens 0` (no rehearsal) encodes nothing."""
    system = SYSTEM * 3                 # (a text under 2048 characters is encoded whole)
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "hello"}], "max_tokens": 3,
            "temperature": 0.0}
    s = start_server(qwen_dir, prompt_cache_dir=str(tmp_path))
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()
        first, answer = r["usage"]["prompt_tokens"], r["choices"][0]["message"]["content"]
        s.state.engine.disk_cache.flush()
    finally:
        stop_server(s)
    msgs = body["messages"] + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": "and now?"}]
    for tokens, remembers in ((None, True), (0, False)):
        s = start_server(qwen_dir, prompt_cache_dir=str(tmp_path), warm_up_tokens=tokens)
        try:
            warm = httpx.get(s.url + "/stats", timeout=10).json()["warm_up"]
            tok = s.state.tokenizer
            before = tok.prefix_tokens_reused
            ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            reused = tok.prefix_tokens_reused - before
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            assert ids == tok.encode(text, add_special_tokens=False)
            if remembers:
                assert warm["remembered_tokens"] >= first and reused >= 0.9 * first, (warm, reused)
            else:
                assert warm["remembered_tokens"] == 0 and reused == 0, (warm, reused)
        finally:
            stop_server(s)
