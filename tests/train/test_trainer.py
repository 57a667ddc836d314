"""The trainer end to end: CLI, falling loss, checkpoints, exact resume, errors,
and adapters exchanged with mlx-lm's own CLI."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import engine
from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from parity.fixtures.models import ensure_fixture
from tests.train.helpers import not_equal, write_word_data
from train.cli import main
from train.data import load_data_dir
from train.trainer import TrainConfig, train

PROMPT = mx.array([[5, 17, 300, 42, 9, 801, 77, 3, 128, 64, 11, 12]])


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    return write_word_data(tmp_path_factory.mktemp("words"))


def _cli(model, data, out, *extra):
    return main(["--model", str(model), "--data", str(data), "--adapter-path", str(out),
                 "--batch-size", "4", "--learning-rate", "1e-3", "--val-batches", "-1",
                 *extra])


def _val_losses(capsys_text):
    return [float(l.split("Val loss ")[1].split(",")[0]) for l in capsys_text.splitlines()
            if "Val loss" in l]


def test_cli_learns_uppercase_answers(words, tmp_path, capsys):
    p = ensure_fixture("qwen3")
    out = tmp_path / "ad"
    rc = _cli(p, words, out, "--iters", "32", "--steps-per-eval", "16", "--steps-per-report", "8",
              "--save-every", "16")
    text = capsys.readouterr().out
    assert rc == 0, text
    vals = _val_losses(text)
    assert len(vals) == 3 and vals[-1] < 0.5 * vals[0], vals
    assert "tok/s" in text and "peak" in text and "loss" in text
    for f in ("adapters.safetensors", "adapter_config.json", "0000016_adapters.safetensors",
              "0000032_adapters.safetensors"):
        assert (out / f).exists(), f
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["num_layers"] == -1
    assert cfg["lora_parameters"] == {"rank": 8, "dropout": 0.0, "scale": 20.0}
    # the mounted adapter makes an unseen-order prompt's uppercase answer likely
    from train.data import tokenize_row
    row = {"messages": [{"role": "user", "content": "river"},
                        {"role": "assistant", "content": "RIVER"}]}
    ex = tokenize_row(row, "chat", load_tokenizer(p), mask_prompt=True)
    ids = mx.array(ex.tokens)[None]
    tuned, _ = engine.load(p, adapter_path=out)

    def nll(m):
        logits = m(ids[:, :-1])[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tgt = ids[0, 1:]
        picked = mx.take_along_axis(lp, tgt[:, None], axis=-1)[:, 0]
        return -picked[ex.offset - 1:].mean().item()

    assert nll(tuned) < 0.5 * nll(load_model(p)[0])


def test_segmented_cli_run_is_identical(words, tmp_path, capsys):
    p = ensure_fixture("gemma4_text")
    a, b = tmp_path / "full", tmp_path / "seg"
    assert _cli(p, words, a, "--iters", "6", "--steps-per-eval", "3") == 0
    la = [l for l in capsys.readouterr().out.splitlines() if "Iter" in l]
    assert _cli(p, words, b, "--iters", "6", "--steps-per-eval", "3", "--segment-size", "2") == 0
    lb = [l for l in capsys.readouterr().out.splitlines() if "Iter" in l]
    strip = lambda ls: [l.split(" | ")[0].split("took")[0] for l in ls]  # noqa: E731
    assert strip(la) == strip(lb)
    assert not not_equal(mx.load(str(a / "adapters.safetensors")),
                         mx.load(str(b / "adapters.safetensors")))


def _run(p, words, out, iters, **kw):
    d = load_data_dir(words, load_tokenizer(p))
    cfg = TrainConfig(adapter_path=str(out), iters=iters, batch_size=4, learning_rate=1e-3,
                      num_layers=-1, steps_per_eval=3, val_batches=1, save_every=3, **kw)
    return train(load_model(p)[0], cfg, d["train"], d["valid"], log=lambda *_: None)


@pytest.mark.parametrize("kw", [dict(), dict(grad_accumulation=2), dict(dropout=0.1),
                                dict(segment_size=1, dropout=0.1, optimizer="adamw")],
                         ids=["plain", "accum", "dropout", "segmented-dropout-adamw"])
def test_resume_is_exact(words, tmp_path, kw):
    """7 iterations in one go == 3 iterations, stop, --resume to 7 (the resumed run
    restores optimiser state, batch order, PRNG key and pending accumulated grads)."""
    p = ensure_fixture("llama")
    _run(p, words, tmp_path / "straight", 7, **kw)
    _run(p, words, tmp_path / "split", 3, **kw)
    _run(p, words, tmp_path / "split", 7, resume=True, **kw)
    a = mx.load(str(tmp_path / "straight" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "split" / "adapters.safetensors"))
    assert not not_equal(a, b)


def test_cli_errors(tmp_path, capsys):
    p = ensure_fixture("llama")
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    assert _cli(p, d, tmp_path / "o") == 2
    assert "train.jsonl:2: invalid JSON" in capsys.readouterr().err
    write_word_data(d)
    assert _cli(p, d, tmp_path / "o", "--num-layers", "5") == 2
    assert "model has 2 blocks" in capsys.readouterr().err
    assert _cli(tmp_path, d, tmp_path / "o") == 2
    assert "cannot load model" in capsys.readouterr().err
    assert _cli(p, d, tmp_path / "o2", "--resume") == 2
    assert "nothing to resume" in capsys.readouterr().err


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_mlx_lm_cli_adapter_round_trip(family, words, tmp_path, capsys):
    """`python -m mlx_lm lora --train ... --num-layers -1` on a fixture: our engine
    mounts its adapter with mlx_lm.load's logits, and our CLI with the same
    settings writes bit-identical adapter weights."""
    p = ensure_fixture(family)
    ref_dir, our_dir = tmp_path / "mlx_lm", tmp_path / "ours"
    common = ["--iters", "4", "--batch-size", "4", "--learning-rate", "1e-3", "--seed", "0",
              "--steps-per-eval", "2", "--val-batches", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "lora", "--model", str(p), "--train",
                        "--data", str(words), "--num-layers", "-1", "--adapter-path", str(ref_dir),
                        *common], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import mlx_lm
    ref_model, _ = mlx_lm.load(str(p), adapter_path=str(ref_dir))
    ours, _ = engine.load(p, adapter_path=ref_dir)
    assert mx.array_equal(ref_model(PROMPT), ours(PROMPT)).item()
    assert not mx.array_equal(load_model(p)[0](PROMPT), ours(PROMPT)).item()
    # our CLI, mlx-lm's defaults (no prompt masking), the same run
    assert main(["--model", str(p), "--data", str(words), "--adapter-path", str(our_dir),
                 "--num-layers", "-1", "--no-mask-prompt", *common]) == 0
    capsys.readouterr()
    assert not not_equal(mx.load(str(ref_dir / "adapters.safetensors")),
                         mx.load(str(our_dir / "adapters.safetensors")))
