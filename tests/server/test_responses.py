"""/v1/responses through the official openai SDK (and the raw event chain)."""

import json

import httpx
import openai
import pytest

from srv_helpers import sse_events, uniq

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"type": "web_search"}]   # built-in: dropped
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def test_plain_equals_in_process(srv, oai):
    q = uniq()
    r = oai.responses.create(model="x", input=q, instructions="be brief", max_output_tokens=9,
                             temperature=0)
    ref = srv.generate([{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": q}],
                          max_tokens=9, temperature=0.0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == ref.text
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    assert r.usage.input_tokens == ref.prompt_tokens
    assert r.usage.output_tokens == len(ref.token_ids)
    assert r.output[0].type == "message" and r.output[0].role == "assistant"


def test_system_items_merge_with_instructions(srv, oai):
    q = uniq()
    r = oai.responses.create(model="x", instructions="A", max_output_tokens=5, temperature=0,
                             input=[{"role": "developer", "content": "B"},
                                    {"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": q}]}])
    ref = srv.generate([{"role": "system", "content": "A\n\nB"},
                                                     {"role": "user", "content": q}],
                          max_tokens=5, temperature=0.0)
    assert r.output_text == ref.text and r.usage.input_tokens == ref.prompt_tokens


CHAIN = ["response.created", "response.in_progress", "response.output_item.added",
         "response.content_part.added"]
TAIL = ["response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]


def test_stream_event_chain(srv, oai):
    q = uniq()
    full = oai.responses.create(model="x", input=q, max_output_tokens=6, temperature=0)
    body = {"input": q, "max_output_tokens": 6, "temperature": 0, "stream": True}
    evs = sse_events(httpx.post(srv.v1 + "/responses", json=body, timeout=30).text)
    names = [n for n, _ in evs]
    # a stream stopped by the token limit ends response.incomplete (status incomplete)
    last = "response.incomplete" if full.status == "incomplete" else "response.completed"
    assert names[:4] == CHAIN and names[-4:] == TAIL[:-1] + [last]
    assert evs[-1][1]["response"]["status"] == full.status
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
    assert text == full.output_text
    done = evs[-1][1]["response"]
    assert done["usage"]["output_tokens"] == full.usage.output_tokens
    assert done["usage"]["input_tokens_details"]["cached_tokens"] > 0
    # the SDK's stream helper assembles the same text (its get_final_response() needs
    # response.completed, so it is read from the events: a length stop is incomplete)
    with oai.responses.stream(model="x", input=q, max_output_tokens=6, temperature=0) as s:
        text = "".join(ev.delta for ev in s if ev.type == "response.output_text.delta")
    assert text == full.output_text


def test_previous_response_id(srv, oai):
    q1, q2 = uniq("first"), uniq("second")
    r1 = oai.responses.create(model="x", input=q1, instructions="sys", max_output_tokens=6,
                              temperature=0)
    r2 = oai.responses.create(model="x", input=q2, previous_response_id=r1.id,
                              max_output_tokens=6, temperature=0)
    convo = [{"role": "system", "content": "sys"}, {"role": "user", "content": q1},
             {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": q2}]
    ref = srv.generate(convo, max_tokens=6, temperature=0.0)
    # the stored turn was spliced in (instructions carried forward) ...
    assert r2.usage.input_tokens == ref.prompt_tokens
    # ... and its prefix came from the prompt cache
    assert r2.usage.input_tokens_details.cached_tokens > 0
    assert r2.previous_response_id == r1.id
    # chains: a third turn on r2 sees all of it
    r3 = oai.responses.create(model="x", input="third", previous_response_id=r2.id,
                              max_output_tokens=2, temperature=0)
    assert r3.usage.input_tokens > r2.usage.input_tokens
    st = httpx.get(srv.url + "/stats").json()["response_store"]
    assert st["entries"] >= 3 and st["bytes"] > 0
    assert st["max_bytes"] == 32 * 1024 * 1024 and st["ttl_ms"] == 3600000
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="x", input="x", previous_response_id="resp_nope")
    assert "resp_nope" in e.value.body["message"]


def test_function_call_round_trip(srv, forced, oai):
    forced.arm("Looking." + CALL)
    r = oai.responses.create(model="x", input=uniq("weather in Rome"), tools=TOOLS,
                             max_output_tokens=80, temperature=0)
    assert [o.type for o in r.output] == ["message", "function_call"]
    fc = r.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Rome"}
    assert fc.call_id.startswith("call_")
    assert r.output_text == "Looking."

    forced.arm("Looking." + CALL)
    body = {"input": uniq("weather in Rome"), "tools": TOOLS, "max_output_tokens": 80,
            "temperature": 0, "stream": True}
    evs = sse_events(httpx.post(srv.v1 + "/responses", json=body, timeout=30).text)
    names = [n for n, _ in evs]
    i = names.index("response.function_call_arguments.delta")
    assert names[i - 1] == "response.output_item.added"
    assert names[i + 1:i + 3] == ["response.function_call_arguments.done",
                                  "response.output_item.done"]
    assert json.loads(evs[i + 1][1]["arguments"]) == {"city": "Rome"}
    assert names[-1] == "response.completed"

    # the tool result goes back as function_call_output, chained on the first response
    forced.arm("Warm.")
    r2 = oai.responses.create(model="x", previous_response_id=r.id, tools=TOOLS,
                              input=[{"type": "function_call_output", "call_id": fc.call_id,
                                      "output": "25C"}], max_output_tokens=10, temperature=0)
    assert r2.output_text == "Warm." and r2.status == "completed"
    assert r2.usage.input_tokens_details.cached_tokens > 0


def test_bad_input_400(srv, oai):
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="x", input=[{"type": "mystery"}])
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="x", input="x", max_output_tokens=0)
    r = oai.responses.create(model="x", input="still serving", max_output_tokens=2)
    assert r.status in ("completed", "incomplete")


def test_retrieve_and_delete_stored_responses(srv, oai):
    """GET /v1/responses/{id} returns the stored final object (plain and streamed turns);
    DELETE forgets it, after which neither retrieval nor continuation finds it."""
    r = oai.responses.create(model="x", input=uniq(), max_output_tokens=5, temperature=0)
    got = oai.responses.retrieve(r.id)
    assert (got.id, got.status, got.output_text, got.usage.output_tokens) == \
        (r.id, r.status, r.output_text, r.usage.output_tokens)
    raw = httpx.get(srv.v1 + f"/responses/{r.id}").json()
    assert raw["object"] == "response" and raw["output"][0]["type"] == "message"
    body = {"input": uniq(), "max_output_tokens": 5, "temperature": 0, "stream": True}
    evs = sse_events(httpx.post(srv.v1 + "/responses", json=body, timeout=30).text)
    final = evs[-1][1]["response"]
    streamed = httpx.get(srv.v1 + f"/responses/{final['id']}").json()
    assert streamed["status"] == final["status"] and streamed["usage"] == final["usage"]
    assert streamed["output"] == final["output"]
    before = httpx.get(srv.url + "/stats").json()["response_store"]
    d = oai.responses.delete(r.id)
    assert d is None or getattr(d, "deleted", True)
    after = httpx.get(srv.url + "/stats").json()["response_store"]
    assert after["entries"] == before["entries"] - 1 and after["bytes"] < before["bytes"]
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id),
                 lambda: oai.responses.create(model="x", input="more", max_output_tokens=2,
                                              previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    raw = httpx.delete(srv.v1 + "/responses/resp_unknown")
    assert raw.status_code == 404 and raw.json()["error"]["type"] == "not_found_error"


def test_metadata_user_and_parallel_tool_calls_are_echoed(srv):
    """They were always {}, null and true in the object (a probe with Codex-shaped requests),
    streamed or not, and in GET."""
    body = {"model": "m", "input": "hi", "max_output_tokens": 4, "metadata": {"a": "b"},
            "user": "u-1", "parallel_tool_calls": False}
    r = httpx.post(srv.v1 + "/responses", json=body, timeout=30).json()
    want = {"metadata": {"a": "b"}, "user": "u-1", "parallel_tool_calls": False}
    assert {k: r[k] for k in want} == want
    got = httpx.get(srv.v1 + f"/responses/{r['id']}", timeout=30).json()
    assert {k: got[k] for k in want} == want
    evs = sse_events(httpx.post(srv.v1 + "/responses", json={**body, "stream": True},
                                timeout=30).text)
    done = evs[-1][1]["response"]      # (response.completed, or .incomplete at the limit)
    assert {k: done[k] for k in want} == want
    plain = httpx.post(srv.v1 + "/responses", json={"model": "m", "input": "hi",
                                                    "max_output_tokens": 4}, timeout=30).json()
    assert (plain["metadata"], plain["user"], plain["parallel_tool_calls"]) == ({}, None, True)
