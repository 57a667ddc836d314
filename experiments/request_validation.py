"""What validating a request body against its pydantic model costs, per request.

    python -m experiments.request_validation [--repeat 2000]

For a few typical bodies: `json.loads` of the raw bytes (the parse every request
already pays), `Model.model_validate` of the parsed dict (what FastAPI adds), and the
protocol parser that builds the call from the validated model (`parse_chat` & co. on a
stand-in server state: messages, tools, constraints). Microseconds per
call, best of 5 rounds; printed as a table (nothing is written).
"""

from __future__ import annotations

import argparse
import json
import timeit
from types import SimpleNamespace

import pandas as pd

from server.schemas.anthropic import MessagesRequest
from server.schemas.openai import ChatCompletionRequest
from server.schemas.responses import ResponsesRequest

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
TURNS = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20}
         for i in range(10)]
BODIES = {
    "chat, 1 message": (ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
        "temperature": 0.7, "stream": True}),
    "chat, 10 messages + 2 tools": (ChatCompletionRequest, {
        "model": "m", "messages": TURNS, "max_tokens": 64, "temperature": 0.7,
        "top_p": 0.9, "tools": [TOOL, TOOL], "tool_choice": "auto", "stop": ["\n\n"]}),
    "messages, 10 turns": (MessagesRequest, {
        "model": "m", "max_tokens": 64, "system": "be brief", "messages": TURNS,
        "temperature": 0.7}),
    "responses, string input": (ResponsesRequest, {
        "model": "m", "input": "hi", "max_output_tokens": 64, "instructions": "be brief"}),
}


def _state():
    """Enough of a server state for the protocol parsers (no model, no tokenizer use)."""
    from server.store import ResponseStore
    cfg = SimpleNamespace(template_kwargs={}, thinking=False)
    return SimpleNamespace(config=cfg, vocab_size=32000, store=ResponseStore())


def _parser(model):
    from server.anthropic import parse_messages
    from server.openai import parse_chat
    from server.responses import parse_responses
    return {ChatCompletionRequest: parse_chat, MessagesRequest: parse_messages,
            ResponsesRequest: parse_responses}[model]


def best_us(fn, repeat: int) -> float:
    return min(timeit.repeat(fn, number=repeat, repeat=5)) / repeat * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args(argv)
    state = _state()
    rows = []
    for name, (model, body) in BODIES.items():
        raw = json.dumps(body).encode()
        parse = _parser(model)
        valid = model.model_validate(body)
        rows.append({"body": name, "bytes": len(raw),
                     "json.loads us": best_us(lambda: json.loads(raw), args.repeat),
                     "model_validate us": best_us(lambda: model.model_validate(body),
                                                  args.repeat),
                     "protocol parser us": best_us(lambda: parse(valid, state), args.repeat)})
    df = pd.DataFrame(rows).set_index("body")
    df["validate / parser"] = df["model_validate us"] / df["protocol parser us"]
    print(df.round(2).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
