"""Every CLI (engine-generate, engine-serve, engine-train, engine-convert) answers a bad
flag in one line with exit status 2: the flag named, the closest flag suggested for a
typo, mlx-lm flags it does not implement named as such; no usage dump."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.argparsing import CliParser
from engine.cli import parser as generate_parser
from engine.convert import parser as convert_parser
from server.cli import parser as serve_parser
from train.cli import build_parser as train_parser

ROOT = Path(__file__).resolve().parents[2]
PARSERS = {"engine-generate": generate_parser, "engine-serve": serve_parser,
           "engine-train": train_parser, "engine-convert": convert_parser}


def _error(capsys, make, argv) -> str:
    with pytest.raises(SystemExit) as e:
        make().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    return err.strip()


@pytest.mark.parametrize("prog", list(PARSERS))
def test_every_cli_uses_the_shared_parser(prog):
    p = PARSERS[prog]()
    assert isinstance(p, CliParser) and p.prog == prog


@pytest.mark.parametrize("prog,typo,meant", [
    ("engine-generate", "--max-tokenz", "--max-tokens"),
    ("engine-generate", "--sytem-prompt", "--system-prompt"),
    ("engine-serve", "--prot", "--port"),
    ("engine-train", "--learning-rte=0.1", "--learning-rate"),
    ("engine-convert", "--mlx-pth", "--mlx-path")])
def test_typo_names_the_flag_and_the_closest_one(capsys, prog, typo, meant):
    err = _error(capsys, PARSERS[prog], [typo, "1"])
    flag = typo.split("=")[0]
    assert err == f"{prog}: error: {flag} is not a flag of {prog}; did you mean {meant}?"


def test_unknown_flag_without_a_near_one(capsys):
    err = _error(capsys, generate_parser, ["--zzzzzz"])
    assert "--zzzzzz is not a flag of engine-generate (see engine-generate --help)" in err


@pytest.mark.parametrize("flag,why", [("--quantize-activations", "activation quantization")])
def test_mlx_lm_flags_we_do_not_implement_are_named(capsys, flag, why):
    err = _error(capsys, generate_parser, [flag, "x"])
    assert f"{flag} is not supported by engine-generate: {why}" in err


def test_convert_names_upload_repo(capsys):
    err = _error(capsys, convert_parser, ["--hf-path", "x", "--upload-repo", "me/m"])
    assert "--upload-repo is not supported by engine-convert" in err


def test_other_argparse_errors_stay_one_line(capsys):
    assert "invalid float value" in _error(capsys, generate_parser, ["--temp", "hot"])
    assert "invalid choice" in _error(capsys, convert_parser, ["--hf-path", "x", "--q-mode", "z"])
    assert "required: --hf-path" in _error(capsys, convert_parser, [])


def test_subprocess_exit_status_and_stderr():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "engine.cli", "--max-tokenz", "3"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("engine-generate: error: --max-tokenz is not a flag of engine-generate; "
                        "did you mean --max-tokens?\n")
