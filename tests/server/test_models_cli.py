"""`engine-serve --model A --model B` / `--models-dir` as a user starts it, and the flags
it refuses (issue #40)."""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from server.cli import main, parser
from server.models_catalog import ModelsConfigError, models_config
from srv_helpers import wait_ready_line
from test_cli import spawn

@pytest.fixture(autouse=True)
def keep_memory_limit():
    """main() sets MLX's memory limit to the budget: give this process its own back."""
    import mlx.core as mx
    old = mx.set_memory_limit(1 << 40)
    mx.set_memory_limit(old)
    yield
    mx.set_memory_limit(old)


READY = re.compile(r"engine-serve ready: (http://[\d.]+:\d+) models=(.+?) \(default (\S+);")


def wait_ready(p, timeout=90):
    return wait_ready_line(p, READY, timeout)


def test_two_models_from_the_command_line(qwen_dir, llama_dir):
    p = spawn("--port", "0", "--model", str(qwen_dir), "--model", f"l={llama_dir}",
              "--pin", "l", "--models-memory-gb", "1.5", "--model-idle-ttl", "600",
              "--temp", "0")
    try:
        m, line = wait_ready(p)
        url = m.group(1)
        assert m.group(3) == qwen_dir.name and "pinned l" in line and "1.50 GB" in line
        cards = {c["id"]: c for c in httpx.get(url + "/v1/models").json()["data"]}
        assert cards[qwen_dir.name]["loaded"] is False and cards["l"]["loaded"] is True
        for name in (qwen_dir.name, "l"):
            r = httpx.post(url + "/v1/chat/completions", json={
                "model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["model"] == name
        r = httpx.post(url + "/v1/messages", json={
            "model": "../../etc", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        st = httpx.get(url + "/stats").json()["models"]
        assert st["memory_budget_bytes"] == 1_500_000_000 and st["idle_ttl_s"] == 600
        assert sorted(st["resident"]) == sorted([qwen_dir.name, "l"])
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    # (uvicorn re-raises the signal once it has shut down, as with one model)
    assert p.returncode in (0, -signal.SIGTERM), err
    assert "Traceback" not in err and "terminate called" not in err


@pytest.mark.parametrize("flags, says", [
    (["--pin", "x"], "only with several models"),
    (["--model-idle-ttl", "5"], "only with several models"),
    (["--models-memory-gb", "5"], "only with several models"),
    (["--models-dir", "/nonexistent-dir-x", "--model-id", "a"], "--model-id names one model"),
    (["--models-dir", "/nonexistent-dir-x", "--adapter", "/tmp"], "--adapter is for one model"),
    (["--models-dir", "/nonexistent-dir-x", "--models-memory-gb", "-1"], "must be > 0"),
    (["--models-dir", "/nonexistent-dir-x", "--model-idle-ttl", "0"], "must be > 0"),
])
def test_refused_flag_combinations(flags, says, capsys):
    assert main(["--port", "0", *flags]) == 2
    assert says in capsys.readouterr().err


def test_bad_model_sets_do_not_start(tmp_path, qwen_dir, capsys):
    assert main(["--port", "0", "--models-dir", str(tmp_path / "none")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["--port", "0", "--models-dir", str(tmp_path)]) == 2     # empty
    assert "no model folders" in capsys.readouterr().err
    assert main(["--port", "0", "--model", str(qwen_dir), "--model", str(qwen_dir)]) == 2
    assert "two models are named" in capsys.readouterr().err
    assert main(["--port", "0", "--model", str(qwen_dir), "--model", f"b={qwen_dir}",
                 "--pin", "c"]) == 2
    assert "--pin 'c': no such model" in capsys.readouterr().err
    assert main(["--port", "0", "--model", str(qwen_dir), "--model", f"b={qwen_dir}",
                 "--pin", "b", "--models-memory-gb", "0.0001"]) == 2
    assert "do not fit" in capsys.readouterr().err


def test_one_model_flag_keeps_a_string(qwen_dir):
    from server.cli import config_from_args
    assert config_from_args(parser().parse_args(["--model", str(qwen_dir)])).model == \
        str(qwen_dir)
    assert config_from_args(parser().parse_args([])).model is None


def test_names_are_looked_up_never_joined(qwen_dir):
    mc = models_config([f"a={qwen_dir}"], None, 10**9)
    for hostile in ("../a", "a/..", "./a", "a\x00", 7, None, ["a"]):
        assert mc.entry(hostile) is None
    assert mc.entry("a").path == str(qwen_dir)
    with pytest.raises(ModelsConfigError):
        models_config([], None, 10**9)
