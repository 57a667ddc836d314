"""`engine-serve --chat-template FILE|STRING` replaces the model's chat template
(mlx-lm's flag): the served prompt is the new template's rendering, on the chat
and Anthropic routes alike; a template that does not compile stops the CLI
with its Jinja error."""

from __future__ import annotations

import pytest

from server.cli import config_from_args, parser
from srv_helpers import start_server, stop_server, uniq

TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")


def test_flag_reads_a_file_or_takes_the_string(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert config_from_args(parser().parse_args(["--chat-template", str(f)])).chat_template \
        == TEMPLATE
    assert config_from_args(parser().parse_args(["--chat-template", TEMPLATE])).chat_template \
        == TEMPLATE
    assert config_from_args(parser().parse_args([])).chat_template is None


@pytest.mark.parametrize("bad", ["{% for m in messages %}no end", "   "])
def test_bad_template_is_a_clear_cli_error(bad):
    with pytest.raises(SystemExit) as e:
        config_from_args(parser().parse_args(["--chat-template", bad]))
    assert "--chat-template" in str(e.value.code)


def test_served_prompt_uses_the_override(qwen_dir):
    from anthropic import Anthropic
    from openai import OpenAI

    s = start_server(qwen_dir, chat_template=TEMPLATE, batch=1)
    try:
        q = uniq("hello")
        want = s.tokenizer.encode(f"<<user>> {q}\n<<assistant>> ", add_special_tokens=False)
        oai = OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=60)
        r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": q}],
                                        max_tokens=1)
        assert r.usage.prompt_tokens == len(want)
        claude = Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60)
        n = claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": q}])
        assert n.input_tokens == len(want)
    finally:
        stop_server(s)
