"""What a newcomer sees when starting `engine-serve` with no flags: the ready
text (SDK base URL, chat page, metrics, a curl that works as printed, the
random-weights note) and the one-time kernel-compile notice in the log."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx

from server.first_run import COMPILE_NOTICE
from test_cli import spawn, wait_ready


def test_ready_text_curl_and_compile_notice(tmp_path):
    # a fresh temp dir: MLX's on-disk kernel cache (<tmp>/mlx/<version>/...) is cold
    p = spawn("--port", "0", "--prompt-cache", "0", TMPDIR=str(tmp_path))
    try:
        _, first = wait_ready(p)
        # the ready text is printed in one write: the rest is already there
        lines = [first.rstrip("\n")] + [p.stdout.readline().rstrip("\n") for _ in range(5)]
        url = lines[0].split()[2]
        assert lines[0].startswith("engine-serve ready: http://127.0.0.1:")
        assert f"SDK base URL: {url}/v1" in lines[1]
        assert lines[2].endswith(f"chat page:    {url}/")
        assert lines[3].endswith(f"metrics:      {url}/metrics")
        assert "random" in lines[-1] and "--model" in lines[-1]
        curl = lines[4].split("try:", 1)[1].strip()
        assert curl.startswith(f"curl {url}/v1/chat/completions")
        if shutil.which("curl"):
            out = subprocess.run(["bash", "-c", curl + " -sS"], capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0, out.stderr
            body = json.loads(out.stdout)
        else:   # the same request, from the printed JSON body
            body = httpx.post(url + "/v1/chat/completions",
                              json=json.loads(curl.split("-d ", 1)[1].strip("'")),
                              timeout=120).json()
        assert body["object"] == "chat.completion"
        assert httpx.post(url + "/v1/messages", timeout=60, json={
            "model": "m", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        assert httpx.get(url + "/", timeout=30).status_code == 200
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert err.count(COMPILE_NOTICE) == 1, err

    # the same machine again: the kernels are cached, so no notice
    p = spawn("--port", "0", "--prompt-cache", "0", TMPDIR=str(tmp_path))
    try:
        url = wait_ready(p)[0].group(1)
        assert httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert COMPILE_NOTICE not in err, err


def test_kernel_cache_cold_follows_the_cache_directory(tmp_path, monkeypatch):
    import mlx.core as mx

    from server.first_run import kernel_cache_cold, kernel_cache_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)      # re-read TMPDIR
    d = kernel_cache_dir()
    assert d == tmp_path / "mlx" / mx.__version__ / "cpu"
    assert kernel_cache_cold()
    d.mkdir(parents=True)
    assert kernel_cache_cold()               # empty: still cold
    (d / "libkernel.so").write_bytes(b"")
    assert not kernel_cache_cold()
