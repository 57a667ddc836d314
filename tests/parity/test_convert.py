"""engine-convert == mlx_lm.convert, byte for byte, on transformers-layout checkpoints.

The sources are fixture models re-saved as transformers saves a checkpoint
(`parity.hf_layout`). For each option set both converters run on the same
source; every file mlx-lm writes must exist in our output with identical
bytes (weights, index, config, tokenizer files, generation config, model
card), and the converted model's logits (our loader) equal mlx-lm's logits on
its own output (`mx.array_equal`).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engine.convert import ConvertOptions, convert
from parity.hf_layout import write_hf_checkpoint, write_hub_cache

pytestmark = pytest.mark.parity
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {f"{fam}-{dt}": write_hf_checkpoint(fam, root / f"{fam}-{dt}", dt,
                                              classic_rope=fam == "llama")
           for fam, dt in (("qwen3", "bfloat16"), ("llama", "bfloat16"), ("qwen3", "float32"))}
    # a checkpoint that names its dtype the pre-5.x way (torch_dtype): both converters cast
    legacy = write_hf_checkpoint("llama", root / "llama-legacy", "float32", classic_rope=True)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (legacy / "config.json").write_text(json.dumps(cfg, indent=2))
    out["llama-legacy"] = legacy
    return out


def _mlx_lm_convert(src, dst, **kw):
    from mlx_lm.convert import convert as oracle
    oracle(str(src), str(dst), **kw)


def assert_same_files(ours: Path, theirs: Path):
    names = sorted(p.name for p in theirs.iterdir())
    assert names == sorted(p.name for p in ours.iterdir())
    differ = [n for n in names if (ours / n).read_bytes() != (theirs / n).read_bytes()]
    assert not differ, f"files differ from mlx_lm.convert's: {differ}"


def assert_same_logits(ours: Path, theirs: Path):
    import engine
    from mlx_lm import load as oracle_load
    m, tok = engine.load(ours)
    r, _ = oracle_load(str(theirs))
    ids = mx.array([tok.encode("The quick brown fox jumps over the lazy dog")])
    a, b = m(ids), r(ids)
    assert a.dtype == b.dtype and mx.array_equal(a, b)


CASES = {
    "plain": ("qwen3-bfloat16", {}, {}),
    "q4": ("llama-bfloat16", {"quantize": True}, {"quantize": True}),
    "q8-g32-fp16": ("qwen3-bfloat16", {"quantize": True, "q_bits": 8, "q_group_size": 32,
                                       "dtype": "float16"},
                    {"quantize": True, "q_bits": 8, "q_group_size": 32, "dtype": "float16"}),
    "mixed_3_6": ("llama-bfloat16", {"quantize": True, "quant_predicate": "mixed_3_6",
                                     "q_group_size": 32},
                  {"quantize": True, "quant_predicate": "mixed_3_6", "q_group_size": 32}),
    "torch_dtype": ("llama-legacy", {}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_convert_matches_mlx_lm_byte_for_byte(case, hf, tmp_path):
    src, ours_kw, theirs_kw = CASES[case]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    convert(hf[src], ours, ConvertOptions(**ours_kw), log=lambda _: None)
    _mlx_lm_convert(hf[src], theirs, **theirs_kw)
    assert_same_files(ours, theirs)
    assert_same_logits(ours, theirs)


class _Bytes(int):
    """mlx-lm's shard limit is `gb << 30`; this int hands it a byte count instead."""

    def __lshift__(self, _):
        return int(self)


def test_sharded_output_matches_mlx_lm(hf, tmp_path, monkeypatch):
    import mlx_lm.utils as U
    limit = 100_000
    monkeypatch.setattr(U, "make_shards", functools.partial(U.make_shards,
                                                            max_file_size_gb=_Bytes(limit)))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    convert(hf["qwen3-float32"], ours, ConvertOptions(max_shard_bytes=limit), log=lambda _: None)
    _mlx_lm_convert(hf["qwen3-float32"], theirs)
    assert len(list(ours.glob("model-*-of-*.safetensors"))) > 1
    assert_same_files(ours, theirs)
    assert_same_logits(ours, theirs)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.convert", *args], capture_output=True,
                          text=True, timeout=120, env={**__import__("os").environ,
                                                      "PYTHONPATH": str(ROOT)})


def test_cli_converts_and_refuses_bad_input_cleanly(hf, tmp_path):
    dst = tmp_path / "q"
    ok = _cli("--hf-path", str(hf["llama-bfloat16"]), "--mlx-path", str(dst), "-q",
              "--q-bits", "8")
    assert ok.returncode == 0, ok.stderr
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    odd = tmp_path / "odd"
    odd.mkdir()
    cfg = json.loads((hf["llama-bfloat16"] / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_arch"}))
    shutil.copy(hf["llama-bfloat16"] / "model.safetensors", odd / "model.safetensors")
    for args, words in [
        (("--hf-path", str(odd), "--mlx-path", str(tmp_path / "z")), "unsupported model_type"),
        (("--hf-path", str(hf["llama-bfloat16"]), "--mlx-path", str(dst)), "already exists"),
        (("--hf-path", str(tmp_path / "nope"), "--mlx-path", str(tmp_path / "x")),
         "no such directory"),
        (("--hf-path", str(hf["llama-bfloat16"]), "--mlx-path", str(tmp_path / "y"),
          "--quant-predicate", "mixed_3_6"), "needs -q"),
    ]:
        bad = _cli(*args)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr


def test_oracle_quirk_mlx_lm_llama_ignores_rope_parameters(tmp_path):
    """transformers 5 writes llama's rope settings only as `rope_parameters`; mlx-lm
    0.32.2's llama reads only `rope_theta`/`rope_scaling`, so it silently runs
    theta 10000 without llama3 scaling. We read `rope_parameters`: our logits on
    the new-style config equal the logits on the same checkpoint with the classic
    keys (where mlx-lm agrees bit for bit, above), and mlx-lm's differ."""
    import engine
    from mlx_lm import load as oracle_load
    new = write_hf_checkpoint("llama", tmp_path / "new", "float32")
    old = write_hf_checkpoint("llama", tmp_path / "old", "float32", classic_rope=True)
    assert "rope_theta" not in json.loads((new / "config.json").read_text())
    m_new, tok = engine.load(new)
    m_old, _ = engine.load(old)
    r_new, _ = oracle_load(str(new))
    ids = mx.array([tok.encode("The quick brown fox jumps over the lazy dog")])
    assert mx.array_equal(m_new(ids), m_old(ids))
    assert not mx.array_equal(r_new(ids), m_new(ids))


def test_mixed_recipe_without_group_size_records_the_group_mlx_lm_leaves_null(hf, tmp_path):
    """mlx_lm.convert hands a mixed recipe `--q-group-size` as given (None when not set),
    so its config records `"group_size": null` per layer (MLX then quantizes with 64).
    We record the group actually used (64): same weight bytes, config differs there only."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    convert(hf["llama-bfloat16"], ours, ConvertOptions(quantize=True,
                                                       quant_predicate="mixed_3_6"),
            log=lambda _: None)
    _mlx_lm_convert(hf["llama-bfloat16"], theirs, quantize=True, quant_predicate="mixed_3_6")
    assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
    a = json.loads((ours / "config.json").read_text())
    b = json.loads((theirs / "config.json").read_text())
    layers = [k for k in b["quantization"] if isinstance(b["quantization"][k], dict)]
    assert layers and all(b["quantization"][k]["group_size"] is None for k in layers)
    for k in layers:
        b["quantization"][k]["group_size"] = 64
    b["quantization_config"] = b["quantization"]
    assert a == b
    assert_same_logits(ours, theirs)


def test_convert_from_a_hub_id(hf, tmp_path, monkeypatch):
    """A repo id resolves through the hub cache (offline); the output equals converting
    the directory itself, except the model card, which names the id as base model."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    write_hub_cache(cache, "acme/tiny-llama", hf["llama-bfloat16"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    by_id, by_dir = tmp_path / "by-id", tmp_path / "by-dir"
    convert("acme/tiny-llama", by_id, ConvertOptions(quantize=True), log=lambda _: None)
    convert(hf["llama-bfloat16"], by_dir, ConvertOptions(quantize=True), log=lambda _: None)
    names = sorted(p.name for p in by_dir.iterdir())
    assert names == sorted(p.name for p in by_id.iterdir())
    for n in names:
        if n != "README.md":
            assert (by_id / n).read_bytes() == (by_dir / n).read_bytes(), n
    assert "base_model: acme/tiny-llama" in (by_id / "README.md").read_text()


@pytest.mark.parametrize("src,kw", [("llama-bfloat16", {"quantize": True}),
                                    ("llama-bfloat16", {"quantize": True,
                                                        "quant_predicate": "mixed_3_6",
                                                        "q_group_size": 32}),
                                    ("qwen3-bfloat16", {"quantize": True, "q_bits": 8})])
def test_bits_per_weight_line_matches_mlx_lm(src, kw, hf, tmp_path, capsys):
    logged = []
    convert(hf[src], tmp_path / "ours", ConvertOptions(**kw), log=logged.append)
    capsys.readouterr()
    _mlx_lm_convert(hf[src], tmp_path / "theirs", **kw)
    theirs = [ln for ln in capsys.readouterr().out.splitlines() if "bits per weight" in ln]
    ours = [ln for ln in logged if "bits per weight" in ln]
    assert len(theirs) == 1 and ours == [theirs[0].replace("[INFO] ", "")]


@pytest.mark.parametrize("src,kw", [("llama-bfloat16", {}), ("qwen3-bfloat16", {"q_bits": 8}),
                                    ("llama-bfloat16", {"quant_predicate": "mixed_3_6",
                                                        "q_group_size": 32})])
def test_dequantize_matches_mlx_lm_byte_for_byte(src, kw, hf, tmp_path):
    q = tmp_path / "q"
    convert(hf[src], q, ConvertOptions(quantize=True, **kw), log=lambda _: None)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    convert(q, ours, ConvertOptions(dequantize=True), log=lambda _: None)
    _mlx_lm_convert(q, theirs, dequantize=True)
    assert "quantization" not in json.loads((ours / "config.json").read_text())
    assert_same_files(ours, theirs)
    assert_same_logits(ours, theirs)


def test_cli_dequantize_and_its_errors(hf, tmp_path):
    q = tmp_path / "q"
    assert _cli("--hf-path", str(hf["llama-bfloat16"]), "--mlx-path", str(q), "-q").returncode == 0
    ok = _cli("--hf-path", str(q), "--mlx-path", str(tmp_path / "d"), "-d")
    assert ok.returncode == 0, ok.stderr
    assert "quantization" not in json.loads((tmp_path / "d" / "config.json").read_text())
    for args, words in [((str(hf["llama-bfloat16"]), "-d"), "is not quantized"),
                        ((str(q), "-q", "-d"), "not both")]:
        bad = _cli("--hf-path", args[0], "--mlx-path", str(tmp_path / "x"), *args[1:])
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr
        assert not (tmp_path / "x").exists()
