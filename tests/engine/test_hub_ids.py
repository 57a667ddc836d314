"""`--model` / `engine.load` accept a Hugging Face repo id, resolved offline from
a cache directory laid out as huggingface_hub lays it out
(`models--org--name/{refs/main,snapshots/<rev>/...}`); and the built-in model
is cached in the user cache directory, never in the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from parity.hf_layout import write_hub_cache
from starter.models import ensure_fixture

ROOT = Path(__file__).resolve().parents[2]
REPO = "acme/tiny-qwen"
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def qwen_dir():
    return ensure_fixture("qwen3", "bfloat16")


@pytest.fixture
def hub_cache(tmp_path, qwen_dir, monkeypatch):
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    snap = write_hub_cache(cache, REPO, qwen_dir, REV)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, snap


def test_repo_id_resolves_to_the_cached_snapshot(hub_cache):
    from engine.loader import resolve_model_path
    _, snap = hub_cache
    assert resolve_model_path(REPO) == snap
    assert resolve_model_path(REPO, revision=REV) == snap


def test_engine_load_by_repo_id_gives_the_same_logits(hub_cache, qwen_dir):
    import engine
    m_id, tok_id = engine.load(REPO)
    m_dir, tok_dir = engine.load(qwen_dir)
    ids = mx.array([tok_dir.encode("hello world")])
    assert tok_id.encode("hello world") == tok_dir.encode("hello world")
    assert mx.array_equal(m_id(ids), m_dir(ids))


@pytest.mark.parametrize("max_batch", [1, 2])
def test_engine_load_by_repo_id_generates_the_same_tokens(hub_cache, qwen_dir, max_batch):
    from engine import Engine, SamplingParams

    def run(path):
        eng = Engine.load(path, max_batch=max_batch)
        params = SamplingParams(max_tokens=8, temperature=0.0)
        rids = [eng.submit(p, params) for p in ("hello world", "def add(a, b):")]
        toks = {r: [] for r in rids}
        while eng.has_unfinished():
            for out in eng.step():
                toks[out.request_id] += list(out.token_ids)
        return [toks[r] for r in rids]

    by_id = run(REPO)
    assert all(by_id) and by_id == run(qwen_dir)


def test_missing_repo_id_says_what_and_where(hub_cache):
    from engine.loader import ModelLoadError, resolve_model_path
    cache, _ = hub_cache
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path("acme/not-there")
    msg = str(e.value)
    assert "acme/not-there" in msg and str(cache) in msg and "HF_HUB_OFFLINE" in msg
    assert "\n" not in msg


def test_a_file_or_a_bad_path_is_a_clear_error(tmp_path):
    from engine.loader import ModelLoadError, resolve_model_path
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        resolve_model_path(f)
    with pytest.raises(ModelLoadError, match="no such directory"):
        resolve_model_path(tmp_path / "a" / "b")


def test_server_state_names_the_model_by_its_repo_id(hub_cache):
    from server.state import ServerConfig, build_state
    _, snap = hub_cache
    state = build_state(ServerConfig(model=REPO, prompt_cache_bytes=0))
    try:
        assert state.model_id == REPO
        assert Path(state.model_dir) == snap
    finally:
        state.gateway.close()


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def test_cli_loads_a_repo_id_offline_and_fails_cleanly_on_a_missing_one(tmp_path, qwen_dir):
    cache = tmp_path / "hub"
    write_hub_cache(cache, REPO, qwen_dir)
    env = _env(HF_HUB_CACHE=str(cache))
    ok = subprocess.run([sys.executable, "-m", "engine.cli", "--model", REPO, "--prompt", "hi",
                         "--max-tokens", "2"], env=env, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "Generation: 2 tokens" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "--model", "acme/missing"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "acme/missing" in lines[0] and str(cache) in lines[0]


def test_builtin_model_lands_in_the_xdg_cache(tmp_path):
    """With MLXP_FIXTURE_DIR unset, the built-in model is built under
    $XDG_CACHE_HOME/mlx-parity/builtin (not in the source tree or site-packages)."""
    env = _env(XDG_CACHE_HOME=str(tmp_path))
    env.pop("MLXP_FIXTURE_DIR", None)
    out = subprocess.run([sys.executable, "-c", "import starter; print(starter.default_model_dir())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = Path(out.stdout.strip().splitlines()[-1])
    assert d.parent == tmp_path / "mlx-parity" / "builtin"
    assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
    assert not str(d).startswith(str(ROOT))


def test_serve_and_train_clis_refuse_a_missing_id_with_one_line(hub_cache, tmp_path, capsys):
    from server.cli import main as serve
    from train.cli import main as train
    cache, _ = hub_cache
    assert serve(["--model", "acme/gone", "--port", "0"]) == 2
    assert train(["--model", "acme/gone", "--data", str(tmp_path),
                  "--adapter-path", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("acme/gone" in e and str(cache) in e for e in err), err


def test_builtin_long_model_by_name():
    """`--model builtin:long`: the built-in model with a 131,072-token context (a coding
    agent's first request fits), Qwen3's sampling defaults and EOS rows scaled so its
    random answers end after a few dozen tokens; an unknown name says which exist."""
    import json

    import mlx.core as mx

    from engine.loader import ModelLoadError, resolve_model_path
    from starter import default_model_dir

    long_dir = resolve_model_path("builtin:long")
    base_dir = resolve_model_path("builtin:default")
    assert str(base_dir) == default_model_dir()
    assert json.loads((long_dir / "config.json").read_text())["max_position_embeddings"] == 131072
    gc = json.loads((long_dir / "generation_config.json").read_text())
    assert (gc["temperature"], gc["top_p"], gc["top_k"]) == (0.6, 0.95, 20)
    long_w = mx.load(str(long_dir / "model.safetensors"))["model.embed_tokens.weight"]
    base_w = mx.load(str(base_dir / "model.safetensors"))["model.embed_tokens.weight"]
    eos = gc["eos_token_id"]
    assert mx.array_equal(long_w[eos], base_w[eos] * 8)
    rest = [i for i in range(base_w.shape[0]) if i not in eos]
    assert mx.array_equal(long_w[mx.array(rest)], base_w[mx.array(rest)])
    with pytest.raises(ModelLoadError, match="builtin:default, builtin:long"):
        resolve_model_path("builtin:huge")
