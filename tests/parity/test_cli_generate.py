"""`engine-generate` with mlx_lm.generate's flags prints what `mlx_lm.generate` prints.

Both CLIs run as subprocesses on the built-in tiny models with the same flags; the
completion text must be identical, byte for byte: the chat template applied by default
(and `--ignore-chat-template`), mlx-lm's sampling defaults (greedy, not the model's
generation_config.json), `--system-prompt`, `--prefill-response`, `--max-kv-size`,
`--extra-eos-token`, a seeded temperature, and a `--prompt-cache-file` made by
`mlx_lm.cache_prompt`. With `--verbose` on (the default) both print the same layout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.fixtures.models import ensure_fixture

pytestmark = pytest.mark.parity
ROOT = Path(__file__).resolve().parents[2]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _run(module: list, args: list, cwd=None) -> str:
    r = subprocess.run([sys.executable, "-m", *module, *args], capture_output=True,
                       text=True, timeout=300, env=_env(), cwd=cwd or ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def both(args: list, cwd=None) -> tuple[str, str]:
    return (_run(["mlx_lm", "generate"], args, cwd), _run(["engine.cli"], args, cwd))


@pytest.fixture(scope="module")
def models():
    return {f: str(ensure_fixture(f, "bfloat16")) for f in ("qwen3", "llama", "qwen2")}


CASES = {
    # qwen3's generation_config.json says temperature 0.6, top_k 20: mlx-lm ignores it
    "qwen3-defaults": ("qwen3", ["-p", "Tell me a story", "-m", "24"]),
    "llama-system": ("llama", ["-p", "hi", "-m", "16", "--system-prompt", "Be brief."]),
    "llama-raw": ("llama", ["-p", "def f(x):\\n", "-m", "16", "--ignore-chat-template"]),
    "llama-prefill": ("llama", ["-p", "hi", "-m", "12", "--prefill-response", "Sure,"]),
    "llama-seeded": ("llama", ["-p", "hi", "-m", "20", "--temp", "0.9", "--top-p", "0.9",
                               "--seed", "5"]),
    # the seed is set before the model is built: the same initialisation draws as mlx-lm's
    "qwen3-seeded": ("qwen3", ["-p", "hi", "-m", "20", "--temp", "0.9", "--top-p", "0.9",
                               "--seed", "5"]),
    "qwen2-seeded": ("qwen2", ["-p", "hi", "-m", "20", "--temp", "0.9", "--top-p", "0.9",
                               "--seed", "5"]),
    "qwen3-max-kv": ("qwen3", ["-p", "count " * 12, "-m", "40", "--max-kv-size", "20"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_completion_as_mlx_lm_generate(models, case):
    family, args = CASES[case]
    ref, ours = both(["--model", models[family], *args, "--verbose", "False"])
    assert ours == ref
    assert len(ours.strip()) > 0


def test_extra_eos_token_ends_where_mlx_lm_ends(models):
    """A token of the greedy completion made an extra EOS: both stop before it."""
    import engine

    model, tok = engine.load(models["llama"])
    args = ["--model", models["llama"], "-p", "hi", "-m", "16", "--verbose", "False"]
    full = _run(["engine.cli"], args)
    ids = engine.generate(model, tok, [{"role": "user", "content": "hi"}], max_tokens=16,
                          temperature=0.0).token_ids
    stop = tok.convert_ids_to_tokens(ids[len(ids) // 2])
    ref, ours = both(args + ["--extra-eos-token", stop])
    assert ours == ref and len(ours) < len(full)


def test_verbose_layout_matches(models):
    ref, ours = both(["--model", models["qwen3"], "-p", "hello", "-m", "8"])
    shape = lambda out: [ln.split(":")[0] if ":" in ln else ln for ln in out.splitlines()]
    assert shape(ours) == shape(ref)
    assert ours.split("=" * 10)[1] == ref.split("=" * 10)[1]
    assert [ln.split(":")[0] for ln in ours.splitlines()[-3:]] == [
        "Prompt", "Generation", "Peak memory"]


@pytest.mark.parametrize("family,extra", [("qwen3", []), ("llama", ["--kv-bits", "4"])])
def test_prompt_cache_file_from_mlx_lm_cache_prompt(models, tmp_path, family, extra):
    """`mlx_lm.cache_prompt` saves a prefix; both CLIs continue it with a new prompt
    and give the same text; our own save/load round-trips the file."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.kv.cache_file import load_prompt_cache, save_prompt_cache

    f = tmp_path / "cache.safetensors"
    _run(["mlx_lm", "cache_prompt"], ["--model", models[family], "--prompt-cache-file", str(f),
                                      "--prompt", "You are a poet. Here is some context",
                                      "--quantized-kv-start", "0", *extra], cwd=tmp_path)
    ref, ours = both(["--prompt-cache-file", str(f), "-p", "and more", "-m", "16",
                      "--verbose", "False", *extra], cwd=tmp_path)
    assert ours == ref and ours.strip()
    caches, meta = load_prompt_cache(f)
    assert meta["model"] == models[family] and caches[0].offset > 0
    save_prompt_cache(tmp_path / "again.safetensors", caches, meta)
    again, meta2 = load_prompt_cache(tmp_path / "again.safetensors")
    assert meta2["model"] == meta["model"]
    for a, b in zip(caches, again):
        assert type(a) is type(b) and a.offset == b.offset
        leaves = [[v for _, v in tree_flatten(c.keys)] for c in (a, b)]
        assert all(mx.array_equal(x, y).item() for x, y in zip(*leaves))
    ours2 = _run(["engine.cli"], ["--prompt-cache-file", str(tmp_path / "again.safetensors"),
                                  "-p", "and more", "-m", "16", "--verbose", "False", *extra])
    assert ours2 == ours
