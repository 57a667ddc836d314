"""Quantized KV rows of the continuous batch (engine.kv.batch_quant): on an Engine with a KV
policy quantized from the first token (`kv_bits`, `quantized_kv_start` 0: the server's), text
requests are rows of the batch instead of running one at a time. Each row's caches of the
policy's layers become quantized after its first forward, as the request's alone do, and the
rows decode together over `BatchQuantizedKVCache`s; on the CPU every row's tokens and logprob
vectors equal the same request run alone (max_batch 1: the exact runner, L1 against mlx-lm's
generate_step with kv_bits, tests/parity), prompts over several prefill chunks, rows joining
and leaving, a prompt-cache hit restoring a quantized prefix included. Negative control: rows
that never convert (float KV) give other logprobs."""

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.kv import batch_quant
from engine.kv.batch_quant import BatchQuantizedKVCache
from parity.fixtures.models import ensure_fixture

PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 170)), list(range(30, 52)),
           [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module", params=[("llama", "float32"), ("qwen3", "bfloat16")],
                ids=lambda p: "-".join(p))
def model(request):
    return engine.load(str(ensure_fixture(*request.param)))


def _run(m, tok, max_batch, bits, prompts, cache=None, max_tokens=(12, 20, 7, 15, 9)):
    eng = Engine(m, tok, max_batch=max_batch, kv_bits=bits, kv_group_size=32,
                 quantized_kv_start=0, prefill_step_size=16, keep_logprob_arrays=True,
                 prompt_cache=cache)
    eng.eos = set()
    rids = [eng.submit(p, SamplingParams(max_tokens=n, temperature=0.0))
            for p, n in zip(prompts, max_tokens)]
    got = {r: ([], []) for r in rids}
    peak, eng.kinds, eng.prefill_peak = 0, set(), 0
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None
            got[o.request_id][0].extend(o.token_ids)
            got[o.request_id][1].extend(o.logprob_arrays)
        if eng._sched is not None:
            eng.prefill_peak = max(eng.prefill_peak, len(eng._sched._prefill.rows))
        if eng._sched is not None and eng._sched.decoding > 1:
            peak = max(peak, eng._sched.decoding)
            eng.kinds |= {type(c) for c in eng._sched._decode.caches}
    return [got[r] for r in rids], eng, peak


def _equal(a, b) -> bool:
    return all(ta == tb and len(la) == len(lb) and all(mx.array_equal(x, y).item()
                                                       for x, y in zip(la, lb))
               for (ta, la), (tb, lb) in zip(a, b))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_rows_equal_each_request_alone(model, bits):
    m, tok = model
    alone, _, _ = _run(m, tok, 1, bits, PROMPTS)
    rows, eng, peak = _run(m, tok, 4, bits, PROMPTS)
    assert eng.batching and eng.quant_rows
    assert eng.stats()["solo_reasons"] == {} and peak >= 3
    assert _equal(rows, alone)
    assert eng.kinds == {BatchQuantizedKVCache}       # (every layer, while rows shared a step)
    assert eng.prefill_peak >= 3                      # (fresh rows prefilled together)


def test_negative_control_rows_that_keep_float_kv_differ(model, monkeypatch):
    m, tok = model
    alone, _, _ = _run(m, tok, 1, 4, PROMPTS)
    monkeypatch.setattr(batch_quant, "quantize_group", lambda caches, layers: None)
    from engine.step import batch
    monkeypatch.setattr(batch, "quantize_group", lambda caches, layers: None)
    rows, _, _ = _run(m, tok, 4, 4, PROMPTS)
    assert not _equal(rows, alone)


def test_a_prompt_cache_hit_restores_a_quantized_prefix_as_a_row(model):
    """The same prompts again on the same engine: each restores its quantized prefix from the
    prompt cache into the batch (`batch_caches_q`) and still equals its alone run."""
    m, tok = model
    cache = engine.PromptCache(1 << 30)
    alone, _, _ = _run(m, tok, 1, 8, PROMPTS)
    _run(m, tok, 4, 8, PROMPTS, cache=cache)
    again, eng, _ = _run(m, tok, 4, 8, PROMPTS, cache=cache)
    assert cache.stats()["hits"] >= len(PROMPTS) and _equal(again, alone)


def test_an_engine_quantizing_later_runs_requests_alone(model):
    """quantized_kv_start > 0 (rows would convert at different steps): one at a time, as before."""
    m, tok = model
    eng = Engine(m, tok, max_batch=4, kv_bits=8, kv_group_size=32, quantized_kv_start=64)
    assert not eng.quant_rows and not eng.batching
    for p in PROMPTS[:2]:
        eng.submit(p, SamplingParams(max_tokens=4, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["solo_reasons"] == {"kv_quant": 2}


def test_prompt_lookup_rows_with_quantized_kv_equal_alone(model):
    """Prompt-lookup requests are quantized rows too (their verify forwards' rejected columns
    rewound from the quantized caches): tokens and logprobs equal each request alone."""
    m, tok = model
    reps = [[5, 6, 7, 8, 9, 10, 11, 12] * 5, [3, 4, 5, 6] * 6 + [9], list(range(20, 44)) * 2]

    def run(max_batch):
        eng = Engine(m, tok, max_batch=max_batch, kv_bits=8, kv_group_size=32,
                     prefill_step_size=16, keep_logprob_arrays=True)
        eng.eos = set()
        rids = [eng.submit(p, SamplingParams(max_tokens=24, temperature=0.0, prompt_lookup=2,
                                             num_draft_tokens=3)) for p in reps]
        got = {r: ([], []) for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                assert o.error is None
                got[o.request_id][0].extend(o.token_ids)
                got[o.request_id][1].extend(o.logprob_arrays)
        return [got[r] for r in rids], eng.stats()
    alone, _ = run(1)
    rows, st = run(4)
    assert st["solo_reasons"] == {} and st["speculation"]["lookup"]["accepted"] > 0
    assert _equal(rows, alone)


def test_fresh_rows_and_prompt_cache_hits_mixed(model):
    """Queued fresh prompts and prompt-cache hits (quantized prefixes) alternate: each prefill
    group takes rows of one kind, and every request equals its alone run on an engine whose
    prompt cache was filled the same way (a hit changes where the prompt's chunks fall, and
    quantized attention rounds by chunk shape: a hit is compared with a hit)."""
    m, tok = model
    mixed = [PROMPTS[0] + [11, 12], PROMPTS[2] + [5], list(range(60, 90)), [9, 8, 7, 6],
             PROMPTS[4] + [1]]                  # (two hits, two fresh, a hit)
    out = []
    for max_batch in (1, 4):
        cache = engine.PromptCache(1 << 30)
        _run(m, tok, max_batch, 8, PROMPTS[::2], cache=cache, max_tokens=(6, 6, 6))
        got, eng, _ = _run(m, tok, max_batch, 8, mixed, cache=cache)
        assert cache.stats()["hits"] >= 3
        out.append(got)
    assert eng.prefill_peak >= 2 and _equal(out[1], out[0])
