"""`engine-train` as an mlx-lm user runs it: `-c lora.yaml` (mlx_lm.lora's config file,
flags overriding it), `--test`, and one-line errors for what it cannot do."""

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from parity.fixtures.models import ensure_fixture
from tests.train.helpers import not_equal, write_word_data
from train.cli import build_parser, main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    d = write_word_data(tmp_path_factory.mktemp("words"))
    shutil.copy(d / "valid.jsonl", d / "test.jsonl")
    return d


def _yaml(path, model, data, **extra):
    lines = [f"model: {model}", f"data: {data}", "train: true", "fine_tune_type: lora",
             "optimizer: adamw", "optimizer_config:", "  adam: {}",
             "  adamw:", "    weight_decay: 0.05", "seed: 0", "num_layers: -1", "batch_size: 4",
             "iters: 4", "val_batches: 1", "learning_rate: 1e-3", "steps_per_report: 2",
             "steps_per_eval: 2", "save_every: 100", "grad_accumulation_steps: 2",
             "max_seq_length: 2048", "mask_prompt: false", "report_to: null",
             "lora_parameters:", "  rank: 4", "  dropout: 0.0", "  scale: 10.0"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _mlx_lm(*args):
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "lora", *args], capture_output=True,
                       text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.parity
def test_config_file_trains_as_mlx_lm_and_test_loss_matches(words, tmp_path, capsys):
    """The same lora.yaml through both CLIs writes bit-identical adapters; the flag
    given beside -c (--adapter-path) wins over the file; `--test` prints mlx-lm's line."""
    p = ensure_fixture("llama")
    cfg = _yaml(tmp_path / "lora.yaml", p, words, adapter_path=tmp_path / "unused")
    _mlx_lm("-c", str(cfg), "--adapter-path", str(tmp_path / "ref"))
    assert main(["-c", str(cfg), "--adapter-path", str(tmp_path / "ours"), "--test",
                 "--test-batches", "-1"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "unused").exists()
    assert not not_equal(mx.load(str(tmp_path / "ref" / "adapters.safetensors")),
                         mx.load(str(tmp_path / "ours" / "adapters.safetensors")))
    # --test alone: the loss of the saved adapters on test.jsonl, as mlx-lm reports it
    common = ["--model", str(p), "--data", str(words), "--adapter-path", str(tmp_path / "ref"),
              "--test", "--batch-size", "4", "--no-mask-prompt"]
    ref = [ln for ln in _mlx_lm(*[a for a in common if a != "--no-mask-prompt"]).splitlines()
           if ln.startswith("Test loss")]
    assert main(common) == 0
    ours = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Test loss")]
    assert len(ref) == 1 and ours == ref
    assert [ln for ln in out.splitlines() if ln.startswith("Test loss")]


def test_flags_override_the_config_file(words, tmp_path):
    from train.cli import parse_args

    cfg = _yaml(tmp_path / "lora.yaml", "M", words)
    a = parse_args(["-c", str(cfg)])
    assert (a.model, a.iters, a.learning_rate, a.rank, a.scale, a.weight_decay) == (
        "M", 4, 1e-3, 4, 10.0, 0.05)
    assert (a.grad_accumulation, a.mask_prompt, a.optimizer, a.num_layers) == (2, False,
                                                                                "adamw", -1)
    a = parse_args(["-c", str(cfg), "--iters", "9", "--rank", "2", "--model", "N"])
    assert (a.iters, a.rank, a.model) == (9, 2, "N")


def _err(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "usage:" not in err
    return err


def test_one_line_errors(words, tmp_path, capsys):
    base = ["--model", "M", "--data", str(words)]
    assert "--fine-tune-type dora is not supported" in _err(
        capsys, base + ["--fine-tune-type", "dora"])
    assert "--report-to wandb is not supported" in _err(capsys, base + ["--report-to", "wandb"])
    assert "did you mean --iters?" in _err(capsys, base + ["--itres", "3"])
    err = _err(capsys, ["--model", "M", "--data", str(words / "train.jsonl")])
    assert "is a file" in err and "train.jsonl, valid.jsonl" in err
    assert "required: --model, --data" in _err(capsys, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: M\ndata: D\nlr_schedule:\n  name: cosine_decay\n")
    assert "lr_schedule is not supported" in _err(capsys, ["-c", str(bad)])
    bad.write_text("model: M\ndata: D\nlearning_rat: 0.1\n")
    assert "did you mean learning_rate?" in _err(capsys, ["-c", str(bad)])
    bad.write_text("model: M\ndata: D\nlora_parameters:\n  alpha: 3\n")
    assert "lora_parameters.alpha is not supported" in _err(capsys, ["-c", str(bad)])
    assert "no such config file" in _err(capsys, ["-c", str(tmp_path / "none.yaml")])


def test_help_states_each_default_once():
    text = build_parser().format_help()
    for block in text.split("\n  -")[1:]:
        assert block.count("(default:") <= 1, block
    assert "(default: None)" not in text
    assert "16, or all if the model has fewer" in " ".join(text.split())
