"""Speculation flags a probe of engine-serve found taken silently or failing late (0.6.3):
an empty --draft-model (speculation silently off), --num-draft-tokens with nothing to draft,
--draft-model with several models (every request to the model it does not fit got a 503),
a config.json that is JSON but not an object (a traceback at the start)."""

import json
import shutil

import pytest

from engine.loader import ModelLoadError, read_config
from server.cli import config_from_args, parser


@pytest.mark.parametrize("argv, why", [
    (["--draft-model", " "], "--draft-model is empty"),
    (["--num-draft-tokens", "5"], "--num-draft-tokens needs --draft-model or --prompt-lookup"),
])
def test_speculation_flags_that_would_do_nothing_are_refused(argv, why):
    with pytest.raises(SystemExit, match=why):
        config_from_args(parser().parse_args(argv))


def test_a_draft_model_with_several_models_is_refused_before_loading(qwen_dir, llama_dir):
    from server import models_cli
    args = parser().parse_args(["--model", f"a={qwen_dir}", "--model", f"b={llama_dir}",
                                "--draft-model", str(llama_dir)])
    assert models_cli.several(args)
    assert "--draft-model drafts for one model" in models_cli.refusal(args, config_from_args(args))
    one = parser().parse_args(["--model", str(llama_dir), "--draft-model", str(llama_dir)])
    assert not models_cli.several(one)       # (one model: the draft is checked as it loads)


@pytest.mark.parametrize("text", ["[1, 2]", "7", "\"x\""])
def test_a_config_that_is_json_but_not_an_object_is_a_load_error(tmp_path, llama_dir, text):
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    (d / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        read_config(d)
    assert isinstance(read_config(llama_dir), dict) and json.loads((llama_dir / "config.json").read_text())
