"""One parse per request: each protocol builds its call from the request model FastAPI
validated; no handler reads the raw JSON body again (the errors users see are proven
unchanged by the rest of tests/server)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"


def test_no_handler_rereads_the_body():
    assert not (SERVER / "fields.py").exists()
    for f in sorted(SERVER.glob("*.py")):
        src = f.read_text()
        assert not re.search(r"request\.json\(\)|\bbody\.get\(|import fields", src), f.name


def _state():
    cfg = SimpleNamespace(template_kwargs={}, thinking=False)
    return SimpleNamespace(config=cfg, vocab_size=1024, store=None)


@pytest.mark.parametrize("model,parser,body,want", [
    ("openai.ChatCompletionRequest", "openai.parse_chat",
     {"messages": [{"role": "developer", "content": [{"type": "text", "text": "d"}]},
                   {"role": "user", "content": "hi"}],
      "max_tokens": 5, "max_completion_tokens": 7, "temperature": 1, "stop": "x",
      "logit_bias": {"3": 1}, "top_logprobs": 2, "logprobs": True},
     {"messages": [{"role": "system", "content": "d"}, {"role": "user", "content": "hi"}],
      "max_tokens": 7, "temperature": 1.0, "stop": ["x"], "logit_bias": {3: 1.0},
      "top_logprobs": 2, "logprobs": True}),
    ("openai.CompletionRequest", "openai.parse_completion",
     {"prompt": ["abc"], "logprobs": 3, "seed": 4},
     {"prompt": "abc", "top_logprobs": 3, "logprobs": True, "seed": 4, "max_tokens": None}),
    ("anthropic.MessagesRequest", "anthropic.parse_messages",
     {"max_tokens": 9, "system": "s", "stop_sequences": ["", "END"], "top_k": 3,
      "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "r"}],
      "thinking": {"type": "enabled", "budget_tokens": 100}},
     {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                   {"role": "system", "content": "r"}],
      "max_tokens": 9, "stop": ["END"], "top_k": 3,
      "template_kwargs": {"enable_thinking": True}}),
])
def test_the_call_comes_from_the_validated_model(model, parser, body, want):
    import importlib
    mod, cls = model.split(".")
    req = getattr(importlib.import_module(f"server.schemas.{mod}"), cls).model_validate(body)
    mod, fn = parser.split(".")
    call = getattr(importlib.import_module(f"server.{mod}"), fn)(req, _state())
    assert {k: getattr(call, k) for k in want} == want
