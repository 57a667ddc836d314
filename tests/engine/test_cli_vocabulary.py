"""One CLI vocabulary: engine-generate, engine-serve and engine-train accept the same
flag names (mlx-lm's, with the project's own as aliases) for the same things, and
engine-train's flags and defaults are `TrainConfig`'s."""

import dataclasses

import pytest

from engine.cli import parser as generate_parser
from server.cli import parser as serve_parser
from train.cli import COMPUTED, build_parser as train_parser
from train.trainer import TrainConfig

SAMPLING = [["--temp", "0.5"], ["--temperature", "0.5"], ["--top-p", "0.9"], ["--top-k", "4"],
            ["--min-p", "0.1"], ["--max-tokens", "7"], ["--model", "M"],
            ["--adapter-path", "A"], ["--kv-bits", "8"], ["--thinking", "false"],
            ["--memory-budget", "2"], ["--chat-template-args", '{"a": 1}'],
            ["--prefill-step-size", "64"]]


@pytest.mark.parametrize("flag", SAMPLING, ids=lambda f: f[0])
@pytest.mark.parametrize("make", [generate_parser, serve_parser], ids=["generate", "serve"])
def test_generate_and_serve_share_flags(make, flag):
    args = make().parse_args(flag)
    dest = {"--temp": "temperature", "--adapter-path": "adapter_path"}.get(
        flag[0], flag[0][2:].replace("-", "_"))
    if make is serve_parser and dest == "adapter_path":
        dest = "adapter"
    assert getattr(args, dest) is not None


def test_shared_names_in_train():
    base = ["--model", "M", "--data", "D"]
    a = train_parser().parse_args(base + ["--adapter-path", "out", "--seed", "3"])
    assert (a.model, a.adapter_path, a.seed) == ("M", "out", 3)
    assert generate_parser().parse_args(["--seed", "3"]).seed == 3


def test_train_flags_and_defaults_come_from_train_config():
    a = train_parser().parse_args(["--model", "M", "--data", "D"])
    for f in dataclasses.fields(TrainConfig):
        if f.name not in COMPUTED and f.name not in ("model", "data"):
            assert getattr(a, f.name) == f.default, f.name
    a = train_parser().parse_args(["--model", "M", "--data", "D", "--no-mask-prompt",
                                   "--no-compile", "--grad-accumulation-steps", "3",
                                   "--lora-keys", "a,b", "--optimizer", "sgd"])
    assert (a.mask_prompt, a.compile, a.grad_accumulation, a.keys, a.optimizer) == (
        False, False, 3, "a,b", "sgd")
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--model", "M", "--data", "D", "--optimizer", "lion"])


@pytest.mark.parametrize("make", [generate_parser, serve_parser], ids=["generate", "serve"])
def test_every_lever_flag_in_generate_and_serve(make, capsys):
    from engine.levers import LEVER_NAMES

    for name in LEVER_NAMES:
        flag = name.replace("_", "-")
        assert getattr(make().parse_args(["--" + flag]), name) is True
        assert getattr(make().parse_args(["--no-" + flag]), name) is False
    # the removed fast_batch lever: its flag is refused by name (argparse: exit 2)
    with pytest.raises(SystemExit) as e:
        make().parse_args(["--fast-batch"])
    assert e.value.code == 2 and "--fast-batch" in capsys.readouterr().err
