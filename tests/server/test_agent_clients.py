"""What coding agents send and need (Claude Code, Codex CLI, OpenCode): system messages
inside Anthropic `messages`, adaptive thinking with omitted display, the fields they add
(context_management, output_config, metadata, ?beta=true, many tools), no output cap when
the client sets none, the context error for a prompt that cannot fit, and Responses'
reasoning token count. The clients themselves run in experiments/real_clients.py."""

from __future__ import annotations

import httpx
import pytest

from srv_helpers import sse_events, uniq

SCRIPT = "<think>\nweighing 2 and 2\n</think>\n\nThe answer is four."
THOUGHT = "<think>\nweighing 2 and 2\n</think>"
GREEDY = {"temperature": 0}


def test_system_message_after_the_user_turn_is_placed_where_it_occurs(srv):
    q = uniq()
    convo = [{"role": "user", "content": q}, {"role": "system", "content": "be brief"}]
    body = {"model": "x", "max_tokens": 8, "temperature": 0,
            "messages": [convo[0], {"role": "system",
                                    "content": [{"type": "text", "text": "be brief"}]}]}
    r = httpx.post(srv.v1 + "/messages?beta=true", json=body, timeout=30)
    assert r.status_code == 200, r.text
    ref = srv.generate(convo, max_tokens=8, temperature=0.0)
    assert r.json()["content"][0]["text"] == ref.text
    assert r.json()["usage"]["input_tokens"] + r.json()["usage"][
        "cache_read_input_tokens"] == ref.prompt_tokens
    # the same conversation counted: the system turn is in the prompt, after the user turn
    from engine.step.request import encode_prompt
    n = httpx.post(srv.v1 + "/messages/count_tokens", json={
        **body, "thinking": {"type": "disabled"}}, timeout=30).json()["input_tokens"]
    assert n == len(encode_prompt(srv.tokenizer, convo, None, {"enable_thinking": False}))


def test_claude_code_request_fields_are_accepted(srv, forced):
    """The shape of Claude Code 2.x's first request (trimmed): every field accepted."""
    tools = [{"name": f"tool_{i}", "description": "Run a command.", "input_schema": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}
        for i in range(21)]
    body = {"model": "claude-sonnet-5", "max_tokens": 32000, "stream": True,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                              "keep": "all"}]},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": "You are an agent.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": uniq()}]},
                         {"role": "system", "content": "Reminder: be brief."}],
            "tools": tools}
    forced.arm("hello")
    r = httpx.post(srv.v1 + "/messages?beta=true", json=body, timeout=60)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    text = "".join(d["delta"].get("text", "") for name, d in events
                   if name == "content_block_delta")
    assert text == "hello" and events[-1][0] == "message_stop", r.text


def test_adaptive_thinking_thinks_when_the_template_can(srv):
    from engine.step.request import encode_prompt
    msgs = [{"role": "user", "content": uniq()}]
    n = httpx.post(srv.v1 + "/messages/count_tokens", json={
        "model": "m", "messages": msgs, "thinking": {"type": "adaptive"}},
        timeout=30).json()["input_tokens"]
    on = len(encode_prompt(srv.tokenizer, msgs, None, {"enable_thinking": True}))
    off = len(encode_prompt(srv.tokenizer, msgs, None, {"enable_thinking": False}))
    assert on != off and n == on


@pytest.mark.parametrize("stream", [False, True])
def test_omitted_thinking_display_sends_no_thinking_text(srv, forced, claude, stream):
    msgs = [{"role": "user", "content": uniq("2+2?")}]
    thinking = {"type": "adaptive", "display": "omitted"}
    forced.arm(SCRIPT)
    if not stream:
        r = claude.messages.create(model="m", max_tokens=64, messages=msgs,
                                   extra_body={"thinking": thinking})
        blocks = r.content
    else:
        deltas = []
        with claude.messages.stream(model="m", max_tokens=64, messages=msgs,
                                    extra_body={"thinking": thinking}) as s:
            for ev in s:
                if ev.type == "content_block_delta":
                    deltas.append(ev.delta.type)
            blocks = s.get_final_message().content
        assert "thinking_delta" not in deltas and "text_delta" in deltas
    assert [b.type for b in blocks] == ["thinking", "text"]
    assert blocks[0].thinking == "" and blocks[1].text == "The answer is four."


def _captured_max_tokens(srv, send):
    """The max_tokens of the SamplingParams the server queued for `send()`."""
    seen = []
    gw = srv.state.gateway
    submit = gw.submit

    def spy(job):
        seen.append(job.params.max_tokens)
        return submit(job)
    gw.submit = spy
    try:
        out = send()
    finally:
        gw.submit = submit
    assert len(seen) == 1
    return seen[0], out


def test_no_output_cap_when_the_client_sets_none(srv, forced, oai):
    """Codex sends no max_output_tokens: the answer may run to the context's end (as with
    OpenAI), not to a server default; likewise chat/completions without max_tokens."""
    ctx = min(srv.state.engine.max_context, srv.state.admission.max_context())
    forced.arm("ok")
    cap, r = _captured_max_tokens(srv, lambda: oai.responses.create(model="m", input=uniq()))
    assert r.status == "completed" and r.output_text == "ok"
    assert cap == ctx - r.usage.input_tokens
    forced.arm("ok")
    cap, r = _captured_max_tokens(srv, lambda: oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": uniq()}]))
    assert cap == ctx - r.usage.prompt_tokens
    forced.arm("ok")
    cap, r = _captured_max_tokens(srv, lambda: oai.responses.create(
        model="m", input=uniq(), max_output_tokens=7))
    assert cap == 7                                    # a client's cap still wins


def test_a_cap_past_the_context_ends_where_the_context_does(srv, forced, claude):
    """Claude Code asks max_tokens 32,000 (or 128,000) of any model: generation may not
    run past the model's context, so the cap becomes the context left."""
    forced.arm("ok")
    cap, r = _captured_max_tokens(srv, lambda: claude.messages.create(
        model="m", max_tokens=32000, messages=[{"role": "user", "content": uniq()}]))
    prompt = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert cap == srv.state.engine.max_context - prompt
    forced.arm("ok")
    cap, _ = _captured_max_tokens(srv, lambda: claude.messages.create(
        model="m", max_tokens=50, messages=[{"role": "user", "content": uniq()}]))
    assert cap == 50


def test_uncapped_output_is_bounded_by_admission(srv, forced, oai):
    adm = srv.state.admission
    budget = adm.budget_bytes
    adm.budget_bytes = adm.predicted_peak(1000)          # a ceiling under the 4,096 context
    try:
        ceiling = adm.max_context()
        assert ceiling < srv.state.engine.max_context
        forced.arm("ok")
        cap, r = _captured_max_tokens(srv, lambda: oai.responses.create(model="m",
                                                                        input=uniq()))
        assert cap == ceiling - r.usage.input_tokens
    finally:
        adm.budget_bytes = budget


def test_codex_request_fields_are_accepted(srv, forced):
    body = {"model": "gpt-5-codex", "instructions": "You are Codex.", "stream": True,
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": "sandbox: read-only"}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": uniq()}]}],
            "tools": [{"type": "function", "name": "shell", "parameters": {
                "type": "object", "properties": {"cmd": {"type": "string"}}}},
                {"type": "web_search"},
                {"type": "namespace", "name": "mcp", "tools": []}],
            "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k-1"}
    forced.arm("hi")
    r = httpx.post(srv.v1 + "/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "response.completed" in r.text


def test_anthropic_prompt_over_the_context_is_the_context_error(srv):
    """A body whose text cannot fit the context (the default --max-prompt-chars, derived
    from it) is Anthropic's "prompt is too long" 400, not a 413 ("request too large")."""
    ctx = srv.state.max_position
    text = "word " * (16 * ctx // 5 + 10)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(srv.url + path, json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]},
            timeout=30)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
        assert err["message"].startswith("prompt is too long") and str(ctx) in err["message"]
    # over the context in tokens, under the character guard: the same wording
    r = httpx.post(srv.url + "/v1/messages", json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a " * 4200}]},
        timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long")


def test_responses_usage_counts_reasoning_tokens(srv, forced, oai):
    want = len(srv.tokenizer.encode(THOUGHT, add_special_tokens=False))
    forced.arm(SCRIPT)
    r = oai.responses.create(model="m", input=uniq("2+2?"), max_output_tokens=64)
    assert r.output_text == "The answer is four."
    assert r.usage.output_tokens_details.reasoning_tokens == want
    assert 0 < want < r.usage.output_tokens
    forced.arm("no thinking here")
    r = oai.responses.create(model="m", input=uniq(), max_output_tokens=64)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
