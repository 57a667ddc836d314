"""experiments/codex_mcp.py reads the calls out of a streamed answer as Codex would (the
`response.output_item.done` events' call items, with their namespace); a message item or a
delta event is not a call."""

import json

from experiments.codex_mcp import _calls


def test_calls_are_read_from_the_done_events():
    def ev(kind, item):
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, "item": item}) + "\n\n"
    call = {"type": "function_call", "namespace": "mcp__demo", "name": "echo",
            "arguments": '{"text": "hi"}', "call_id": "c1", "status": "completed"}
    body = (ev("response.output_item.added", {**call, "arguments": ""})
            + ev("response.output_item.done", {"type": "message", "content": []})
            + ev("response.output_item.done", call)).encode()
    assert _calls(body) == [{"type": "function_call", "namespace": "mcp__demo", "name": "echo",
                             "arguments": '{"text": "hi"}'}]
    assert _calls(b"data: [DONE]\n\n") == []
