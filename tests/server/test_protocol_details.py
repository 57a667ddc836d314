"""How streams end, through the official SDKs: `stream_options.include_usage`
gives OpenAI's final `choices: []` usage chunk (chat and completions); a
Responses stream stopped by the token limit ends with `response.incomplete`;
`/v1/models` reports the model's context length."""

from __future__ import annotations

import httpx

from srv_helpers import NO_EOS, uniq


def test_chat_include_usage_final_chunk(oai, forced):
    ids = forced.arm("four words right here")
    chunks = list(oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": uniq()}], max_tokens=32, stream=True,
        stream_options={"include_usage": True}))
    last, finish = chunks[-1], chunks[-2]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == len(ids)   # EOS not counted
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert finish.choices[0].finish_reason == "stop" and finish.usage is None
    assert all(c.choices for c in chunks[:-1]) and all(c.usage is None for c in chunks[:-1])


def test_completions_include_usage_final_chunk(oai):
    chunks = list(oai.completions.create(model="m", prompt=uniq(), max_tokens=5, stream=True,
                                         temperature=0, logit_bias=NO_EOS,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].usage is None


def test_without_stream_options_usage_rides_the_finish_chunk(oai):
    chunks = list(oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": uniq()}], max_tokens=3, stream=True,
        temperature=0, logit_bias=NO_EOS))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 3


def test_stream_options_without_stream_is_400(srv):
    for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/completions", {"prompt": "x"})):
        r = httpx.post(srv.v1 + path, json={"model": "m", "max_tokens": 2, **body,
                                            "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = httpx.post(srv.v1 + "/chat/completions", json={
        "model": "m", "stream": True, "stream_options": {"include_usage": "yes"},
        "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400


def test_responses_stream_ends_incomplete_on_the_token_limit(oai):
    # (the SDK's `responses.stream()` helper only knows response.completed; the raw
    # event stream is what agents read)
    evs = list(oai.responses.create(model="m", input=uniq(), max_output_tokens=4, temperature=0,
                                    stream=True, extra_body={"logit_bias": NO_EOS}))
    types = [ev.type for ev in evs]
    final = evs[-1].response
    assert types[-1] == "response.incomplete" and "response.completed" not in types
    assert final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 4
    # the item the limit cut is incomplete too (was "completed"), streamed and not
    assert [o.status for o in final.output] == ["incomplete"]
    r = oai.responses.create(model="m", input=uniq(), max_output_tokens=4, temperature=0,
                             extra_body={"logit_bias": NO_EOS})
    assert r.status == "incomplete" and [o.status for o in r.output] == ["incomplete"]


def test_responses_reasoning_cut_by_the_limit_is_the_whole_answer(oai, forced):
    """A thinking model cut inside its reasoning: one reasoning item, incomplete, and no empty
    message item made up after it."""
    forced.arm("<think>\nlet me think about this for a long while")
    r = oai.responses.create(model="m", input=uniq(), max_output_tokens=5)
    assert r.status == "incomplete"
    assert [(o.type, o.status) for o in r.output] == [("reasoning", "incomplete")]


def test_responses_stream_that_finishes_ends_completed(oai, forced):
    forced.arm("done")
    with oai.responses.stream(model="m", input=uniq(), max_output_tokens=16) as s:
        types = [ev.type for ev in s]
        final = s.get_final_response()
    assert types[-1] == "response.completed" and final.status == "completed"


def test_models_report_the_context_length(srv, oai):
    import json
    want = json.loads((srv.model_dir / "config.json").read_text())["max_position_embeddings"]
    (m,) = oai.models.list().data
    extra = m.model_extra
    assert extra["context_length"] == extra["max_model_len"] == want
    assert extra["max_position_embeddings"] == want
    assert oai.models.retrieve(m.id).model_extra["context_length"] == want


def test_chat_completions_parse_with_a_pydantic_model(oai):
    """The openai SDK's `chat.completions.parse` (a pydantic model as response_format):
    the output is held to the schema, so even the random-weight model parses."""
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=10)
        days: int = Field(ge=1, le=7)

    r = oai.chat.completions.parse(model="m", messages=[{"role": "user", "content": uniq()}],
                                   response_format=Weather, max_tokens=120, temperature=1.0,
                                   seed=3)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 7 and len(parsed.city) <= 10
