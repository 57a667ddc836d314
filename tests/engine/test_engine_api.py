"""The public `Engine` API on the qwen3 fixture: typed options validated once, text /
messages / ids prompts, request ids, abort, lane decisions in stats(), and the
batched lane giving the same text as generate() for greedy requests."""

import pytest

import engine
from engine import Engine, RequestOutput, SamplingParams
from parity.fixtures.models import ensure_fixture


@pytest.fixture(scope="module")
def qwen():
    return engine.load(str(ensure_fixture("qwen3", "bfloat16")))


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=2), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(top_logprobs=21), "top_logprobs"), (dict(repetition_penalty=-1), "repetition_penalty"),
    (dict(repetition_context_size=0), "repetition_context_size"), (dict(seed="x"), "seed"),
    (dict(stop=[1]), "stop"), (dict(logit_bias=[1]), "logit_bias"),
    (dict(xtc_probability=2), "xtc_probability"), (dict(seed=-1), "seed"),
    (dict(seed=2 ** 64), "seed"), (dict(seed=1.5), "seed"), (dict(temperature=2.5), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty")])
def test_sampling_params_validated_once_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)


def test_sampling_params_range_edges_accepted():
    for kw in (dict(seed=0), dict(seed=2 ** 64 - 1), dict(temperature=0), dict(temperature=2),
               dict(presence_penalty=-2, frequency_penalty=2)):
        SamplingParams(**kw)


def test_library_calls_refuse_out_of_range_seed(qwen):
    """The ranges hold for the library API too: a negative seed (which mx.random.key
    cannot take) is a ValueError naming the field, before anything is queued."""
    model, tok = qwen
    with pytest.raises(ValueError, match="^seed "):
        engine.generate(model, tok, "hello", max_tokens=2, temperature=0.5, seed=-1)
    eng = Engine(model, tok, max_batch=4)
    with pytest.raises(ValueError, match="^presence_penalty "):
        eng.submit("hello", SamplingParams(max_tokens=2, presence_penalty=9))
    assert not eng.has_unfinished()


def test_sampling_params_resolve_generation_config(qwen):
    _, tok = qwen
    p = SamplingParams(top_k=3).resolved(tok)
    assert p.top_k == 3 and p.temperature is not None
    assert SamplingParams(stop="x").stop == ("x",)


def _run(eng):
    got = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert isinstance(out, RequestOutput)
            r = got.setdefault(out.request_id, {"text": "", "ids": [], "finish": None})
            r["text"] += out.text
            r["ids"] += out.token_ids
            if out.finished:
                r["finish"] = out.finish_reason
    return got


def test_batched_engine_equals_generate_and_lanes_in_stats(qwen):
    model, tok = qwen
    prompts = ["hello there", [{"role": "user", "content": "hi"}], tok.encode("def f(x):")]
    want = [engine.generate(model, tok, p, max_tokens=8, temperature=0.0) for p in prompts]
    eng = Engine(model, tok, max_batch=4)
    rids = [eng.submit(p, SamplingParams(max_tokens=8, temperature=0.0),
                       request_id=f"r{i}") for i, p in enumerate(prompts)]
    assert rids == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="in use"):
        eng.submit("x", request_id="r0")
    got = _run(eng)
    for rid, w in zip(rids, want):
        assert got[rid]["ids"] == w.token_ids and got[rid]["text"] == w.text
        assert got[rid]["finish"] == w.finish_reason
    st = eng.stats()
    assert st["lanes"] == {"batch": 3, "solo": 0} and st["peak_rows"] == 3


def test_abort_waiting_and_running(qwen):
    model, tok = qwen
    eng = Engine(model, tok, max_batch=1)
    a = eng.submit("one", SamplingParams(max_tokens=50, logit_bias={998: -100, 1000: -100}))
    b = eng.submit("two", SamplingParams(max_tokens=50))
    eng.step()
    eng.step()
    assert eng.abort(b) and eng.abort(a) and not eng.abort(a)
    got = _run(eng)
    assert got[a]["finish"] == got[b]["finish"] == "cancelled"
    assert not eng.has_unfinished()
    assert eng.stats()["solo_reasons"] == {"max_batch=1": 2}


def test_stop_string_reported(qwen):
    model, tok = qwen
    full = engine.generate(model, tok, "hello", max_tokens=12, temperature=0.0).text
    stop = full[3:5]
    r = engine.generate(model, tok, "hello", max_tokens=12, temperature=0.0, stop=[stop])
    assert r.finish_reason == "stop" and r.stop_string == stop and stop not in r.text


def test_submit_errors_are_value_errors(qwen):
    model, tok = qwen
    eng = Engine(model, tok)
    with pytest.raises(ValueError, match="prompt"):
        eng.submit(3.5)
    with pytest.raises(ValueError, match="adapter"):
        eng.submit("x", adapter=("a",))
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, tok, max_batch=0)
    assert not eng.has_unfinished()


def test_quantized_kv_rows_equal_generate(qwen):
    """Quantized from the first token (the default start 0): rows of the batch
    (tests/engine/test_batch_quant.py), each equal to `generate` with the same KV."""
    model, tok = qwen
    want = [engine.generate(model, tok, p, max_tokens=6, temperature=0.0, kv_bits=8,
                            kv_group_size=32).token_ids for p in ("one", "two")]
    eng = Engine(model, tok, max_batch=4, kv_bits=8, kv_group_size=32)
    assert eng.batching
    rids = [eng.submit(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in ("one", "two")]
    got = _run(eng)
    assert [got[r]["ids"] for r in rids] == want
    assert eng.stats()["solo_reasons"] == {} and eng.stats()["peak_rows"] == 2


@pytest.mark.parametrize("bad", [1024, 10 ** 9, -1])
def test_prompt_ids_outside_the_vocabulary_are_a_value_error(qwen, bad):
    """Every way in (Engine lanes, generate, stream_generate, an mx.array prompt) refuses
    an id the embedding has no row for, naming it and the vocabulary size, before any
    compute (the gather does not check its indices: a far id crashed the process)."""
    import mlx.core as mx

    model, tok = qwen
    assert model.args.vocab_size == 1024
    ids = [1, 2, bad, 3]
    msg = rf"token id {bad} is outside the vocabulary \(size 1024\)"
    for eng in (Engine(model, tok), Engine(model, tok, max_batch=4)):
        with pytest.raises(ValueError, match=msg):
            eng.submit(ids, SamplingParams(max_tokens=2))
        assert not eng.has_unfinished()
    with pytest.raises(ValueError, match=msg):
        engine.generate(model, tok, ids, max_tokens=2)
    with pytest.raises(ValueError, match=msg):
        list(engine.stream_generate(model, tok, mx.array(ids), max_tokens=2))
    assert engine.generate(model, tok, [1, 2, 1023], max_tokens=1).token_ids


def test_max_kv_size_and_prefix_caches(qwen):
    """`max_kv_size` bounds full-attention caches (the solo lane runs it, whatever
    max_batch); `prefix_caches` continue a saved context: the same tokens as feeding
    prefix + prompt in one request."""
    from engine.kv.cache import RotatingKVCache

    model, tok = qwen
    ids = tok.encode("count " * 12)
    eng = Engine(model, tok, max_batch=4, max_kv_size=16)
    assert all(isinstance(c, RotatingKVCache) and c.max_size == 16 and c.keep == 4
               for c in eng._new_caches())
    eng.submit(ids, SamplingParams(max_tokens=6, temperature=0.0))
    bounded = _run(eng)
    assert eng.stats()["solo_reasons"] == {"max_kv_size": 1}
    one = engine.generate(model, tok, ids, max_tokens=6, temperature=0.0, max_kv_size=16)
    assert list(bounded.values())[0]["ids"] == one.token_ids
    with pytest.raises(ValueError, match="max_kv_size"):
        Engine(model, tok, max_kv_size=0)

    caches = model.make_cache()
    import mlx.core as mx
    model(mx.array(ids[:10])[None], cache=caches)
    cont = engine.generate(model, tok, ids[10:], max_tokens=6, temperature=0.0,
                           prefix_caches=caches)
    whole = engine.generate(model, tok, ids, max_tokens=6, temperature=0.0)
    assert cont.token_ids == whole.token_ids and cont.prompt_tokens == len(ids) - 10
