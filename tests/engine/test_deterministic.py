"""Deterministic mode (issue #41) on the CPU: a row's logits, bit for bit (`mx.array_equal`),
do not depend on the batch.

The needle test: one prompt decoded alone, then as one row among 1, 7 and 31 other rows of
random prompt lengths that join at random steps and leave mid-flight (random max_tokens, one
aborted) -> the same tokens and the same logprob vectors. The negative control runs the same
inputs without deterministic mode on gemma3_text float32, where they differ (its sliding
window's ring is read in a batch-dependent rotation). Llama and qwen3 are batch-invariant on
the CPU in the default mode too (reports/batch_invariance/0.1.1): their needle runs prove the
mode keeps that, not that it fixes it.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.deterministic import DeterministicUnsupported, why_not_deterministic
from engine.kv.prompt_cache import PromptCache
from engine.levers import parse_spec
from engine.models import bucketed_sdpa
from parity.needle import GREEDY, drive, ids, needle, same
from starter.models import ensure_fixture

_models: dict = {}


def _load(family, dtype="float32"):
    if (family, dtype) not in _models:
        _models[(family, dtype)] = engine.load(str(ensure_fixture(family, dtype)))
    return _models[(family, dtype)]


def _engine(model, tok, **kw):
    kw.setdefault("max_batch", 32)
    return Engine(model, tok, keep_logprob_arrays=True, **kw)


def _needle(model, tok, deterministic, seed=0):
    """[(others, same tokens and logprobs as alone)] for 1, 7 and 31 other rows."""
    rng = random.Random(seed)
    target = ids(rng, 20, 45)
    alone = (_engine(model, tok, max_batch=1, deterministic=deterministic)
             if deterministic else _engine(model, tok, max_batch=2))
    return needle(lambda: _engine(model, tok, deterministic=deterministic), alone, target, rng)


@pytest.mark.parametrize("family,dtype", [
    ("llama", "float32"), ("qwen3", "float32"), ("qwen3", "bfloat16"), ("llama", "q4"),
    ("gemma3_text", "float32"), ("gemma3_text", "bfloat16"), ("gemma3", "float32"),
    ("gemma4_text", "float32")])
def test_needle(family, dtype):
    model, tok = _load(family, dtype)
    assert _needle(model, tok, True) == [(1, True), (7, True), (31, True)]


def test_needle_with_the_window_cut_back_every_few_tokens(monkeypatch):
    """A batched window is written in place after its last column and cut back to the
    window when its room (`step` columns) is used up: with a room of 3, every few steps."""
    from engine.kv.batch_cache import BatchRotatingKVCache
    monkeypatch.setattr(BatchRotatingKVCache, "step", 3)
    model, tok = _load("gemma3_text")
    assert _needle(model, tok, True, seed=4) == [(1, True), (7, True), (31, True)]


def test_needle_negative_control_default_mode_differs():
    """The same inputs without deterministic mode: the row's logprobs change with the batch."""
    model, tok = _load("gemma3_text")
    res = _needle(model, tok, False)
    assert [same for _, same in res] == [False, False, False], res


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_prefill_chunking_does_not_change_the_logits(family):
    model, tok = _load(family)
    prompt = ids(random.Random(3), 50, 50)
    runs = [drive(_engine(model, tok, max_batch=4, deterministic=True, prefill_step_size=n),
                   [(0, prompt, GREEDY)])[0] for n in (2048, 16, 7, 3)]
    assert all(same(r, runs[0]) for r in runs[1:])


def _cached_vs_cold(model, tok, deterministic):
    """A chat turn continuing an earlier one: the prefix (prompt and decoded tokens, 41) comes
    from the prompt cache (prefilled in chunks of 8) or is prefilled cold in one chunk."""
    rng = random.Random(1)
    a = ids(rng, 29, 29)
    eng = _engine(model, tok, max_batch=4, deterministic=deterministic,
                  prompt_cache=PromptCache(1 << 30), prefill_step_size=8)
    first = drive(eng, [(0, a, SamplingParams(max_tokens=12, temperature=0.0))])[0]
    b = a + first[0] + ids(rng, 5, 5)
    warm = drive(eng, [(0, b, GREEDY)])[0]
    assert eng.prompt_cache.stats()["tokens_reused"] == len(a) + 12
    cold = drive(_engine(model, tok, max_batch=4, deterministic=deterministic), [(0, b, GREEDY)])[0]
    return same(warm, cold)


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_a_cached_prefix_gives_the_logits_of_a_cold_one(family):
    model, tok = _load(family)
    assert _cached_vs_cold(model, tok, True)


def test_prefix_files_on_disk_are_kept_apart_from_the_default_modes(tmp_path):
    """A prefix saved by the default mode rounds otherwise (sliding windows): a deterministic
    engine's disk cache does not read it."""
    from engine import disk_cache_for
    model, tok = _load("gemma3_text")
    path = ensure_fixture("gemma3_text")
    det, default = (disk_cache_for(tmp_path, 1.0, path, Engine(model, tok, max_batch=2,
                                                               deterministic=d))
                    for d in (True, False))
    assert det.kv != default.kv and det.model == default.model


def test_cached_prefix_negative_control():
    model, tok = _load("gemma3_text")
    assert not _cached_vs_cold(model, tok, False)


def test_structured_output_and_tool_call_rows_are_batch_invariant():
    """Grammars only mask a row's logits: a JSON-schema row and a forced tool call, seeded
    sampling (each row its own key), alone and among 7 other rows."""
    from engine.constrained import (parse_response_format, parse_tool_choice,
                                    response_format_factory, tool_choice_factory)
    model, tok = _load("gemma3_text")
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "c": {"enum": ["red", "blue"]}},
              "required": ["n", "c"]}
    fmt = parse_response_format({"type": "json_schema",
                                 "json_schema": {"name": "o", "schema": schema, "strict": True}})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"]}}}]
    choice = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    makers = [response_format_factory(tok, fmt),
              tool_choice_factory(tok, "json_tools", tools, choice, parallel=False)]
    rng = random.Random(5)
    for make in makers:
        params = SamplingParams(max_tokens=40, temperature=0.9, seed=11,
                                processor_factories=(make,))
        target = ids(rng, 10, 30)
        alone = drive(_engine(model, tok, max_batch=1, deterministic=True),
                      [(0, target, params)])[0]
        plan = [(rng.randint(0, 4), ids(rng, 1, 40),
                 SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0))
                for _ in range(7)] + [(1, target, params)]
        plan.sort(key=lambda p: p[0])
        t = next(i for i, p in enumerate(plan) if p[1] is target)
        got = drive(_engine(model, tok, max_batch=8, deterministic=True), plan)[t]
        assert len(alone[0]) > 3 and same(got, alone)


def _lookup_vs_plain(model, tok, deterministic, seed):
    """A repetitive prompt decoded with prompt-lookup speculation (drafts verified several
    tokens a forward) and without: (same tokens and logprobs, drafts accepted)."""
    prompt = (ids(random.Random(seed), 5, 5) * 9)[:44]
    runs = []
    for lookup in (0, 2):
        eng = _engine(model, tok, max_batch=4, deterministic=deterministic)
        runs.append(drive(eng, [(0, prompt, SamplingParams(
            max_tokens=40, temperature=0.0, prompt_lookup=lookup, num_draft_tokens=4))])[0])
    return same(*runs), eng.stats()["speculation"]["accepted"]


@pytest.mark.parametrize("family,seed", [("gemma3_text", 0), ("gemma3_text", 4), ("llama", 0)])
def test_prompt_lookup_gives_the_logits_of_plain_decoding(family, seed):
    model, tok = _load(family)
    same, accepted = _lookup_vs_plain(model, tok, True, seed)
    assert same and accepted > 0


def test_prompt_lookup_is_refused_on_sliding_windows_outside_this_mode():
    """The negative control of the test above: without this mode a ring verifying several
    tokens in one forward changed gemma3_text's greedy output, so the default mode refuses
    prompt lookup on sliding-window models (tests/engine/test_prompt_lookup.py)."""
    model, tok = _load("gemma3_text")
    with pytest.raises(ValueError, match="prompt_lookup"):
        _lookup_vs_plain(model, tok, False, 0)


def test_a_request_running_alone_gives_the_batch_rows_logits():
    """The exact runner (a request with its own prefix caches runs alone) and the batch
    runner agree in this mode: the same sliding-window order in both."""
    from engine.kv.cache import temporal_caches
    model, tok = _load("gemma3_text")
    rng = random.Random(7)
    prefix, rest = ids(rng, 30, 30), ids(rng, 9, 9)
    caches = temporal_caches(model.make_cache())
    model(mx.array([prefix]), cache=caches)
    eng = _engine(model, tok, max_batch=4, deterministic=True)
    rid = eng.submit(rest, GREEDY, prefix_caches=caches)
    solo = ([], [])
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                solo[0].extend(o.token_ids)
                solo[1].extend(o.logprob_arrays)
    assert eng.stats()["solo_reasons"] == {"prefix_caches": 1}
    for n in (1, 20, 47):      # beside a shorter and a longer row
        row = drive(_engine(model, tok, max_batch=4, deterministic=True),
                    [(0, ids(rng, n, n), GREEDY), (0, prefix + rest, GREEDY)])[1]
        assert same(solo, row), n


def test_stats_and_max_batch_one():
    model, tok = _load("llama")
    eng = Engine(model, tok, max_batch=1, deterministic=True)
    eng.submit([5, 6, 7], SamplingParams(max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    st = eng.stats()
    assert st["deterministic"] is True and st["lanes"] == {"batch": 1, "solo": 0}
    assert Engine(model, tok, max_batch=1).stats()["deterministic"] is False


def test_refused_with_the_fast_runner_on_metal_and_where_cuda_has_no_kernels(monkeypatch):
    model, tok = _load("llama")
    with pytest.raises(DeterministicUnsupported, match="fast runner"):
        Engine(model, tok, max_batch=4, deterministic=True, levers=parse_spec("l3"))
    gpu = mx.Device(mx.gpu)
    assert why_not_deterministic(parse_spec("l1"), mx.Device(mx.cpu)) is None
    # CUDA (a GPU device where Metal is not): dense full-attention models, float KV
    assert why_not_deterministic(parse_spec("l1"), gpu, model) is None
    assert "quantized KV" in why_not_deterministic(None, gpu, model, kv_quantized=True)
    gemma, _ = _load("gemma3_text")
    assert "full-attention dense models" in why_not_deterministic(None, gpu, gemma)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(bucketed_sdpa, "_CUDA", None)     # (its cached answer, asked again)
    assert "on Metal" in why_not_deterministic(None, gpu, model)
    # the fast path's own switch: refused where it would run, until its kernels exist
    from dataclasses import replace

    from engine.fast.apply import fast_step_for
    lv = parse_spec("l3")
    with pytest.raises(NotImplementedError, match="batch-invariant"):
        fast_step_for(model, replace(lv, fast=replace(lv.fast, deterministic=True)))


def test_engine_generate_refuses_deterministic_with_tier_l3(capsys):
    from engine.cli import main
    assert main(["--deterministic", "--tier", "l3", "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine-generate: --deterministic does not run with the fast runner")


def test_engine_generate_deterministic_runs(capsys):
    from engine.cli import main
    path = str(ensure_fixture("gemma3_text"))
    argv = ["--model", path, "--prompt", "hello there", "--max-tokens", "6", "--verbose",
            "false", "--ignore-chat-template"]
    assert main(argv + ["--deterministic"]) == 0
    det = capsys.readouterr().out
    model, tok = _load("gemma3_text")
    prompt = tok.encode("hello there", add_special_tokens=True)
    ref = drive(_engine(model, tok, max_batch=3, deterministic=True),
                [(0, ids(random.Random(2), 20, 20), GREEDY),
                 (0, prompt, SamplingParams(max_tokens=6, temperature=0.0))])[1]
    assert det == tok.decode(ref[0]) + "\n"


def test_op_level_invariances_the_cpu_mode_relies_on():
    """The stock-MLX CPU properties deterministic mode is built on (engine.deterministic):
    row-invariant matmuls, RMSNorm and log-softmax, attention unchanged by masked keys
    (padding, a chunk's causal part) and by other rows; and what it must avoid: a rotated
    window rounds differently."""
    mx.random.seed(0)
    sdpa = mx.fast.scaled_dot_product_attention
    for dt in (mx.float32, mx.bfloat16):
        w, x = mx.random.normal((96, 64)).astype(dt), mx.random.normal((40, 64)).astype(dt)
        full = x @ w.T
        assert all(mx.array_equal((x[:m] @ w.T)[:m], full[:m]).item() for m in (1, 2, 7, 33))
        wq = mx.quantize(w.astype(mx.float32), group_size=32, bits=4)
        qfull = mx.quantized_matmul(x.astype(mx.float32), *wq, group_size=32, bits=4)
        assert mx.array_equal(mx.quantized_matmul(x[:1].astype(mx.float32), *wq,
                                                  group_size=32, bits=4), qfull[:1]).item()
        S, T, D = 300, 16, 32
        q = mx.random.normal((1, 2, T, D)).astype(dt)
        k, v = (mx.random.normal((1, 1, S + T, D)).astype(dt) for _ in range(2))
        causal = mx.arange(S, S + T)[:, None] >= mx.arange(S + T)[None]
        chunk = sdpa(q, k, v, scale=D ** -0.5, mask=causal)
        one = sdpa(q[:, :, 5:6], k[:, :, :S + 6], v[:, :, :S + 6], scale=D ** -0.5)
        assert mx.array_equal(one, chunk[:, :, 5:6]).item()
        pad = mx.zeros((1, 1, 7, D), dt)
        left = sdpa(q[:, :, 5:6], mx.concatenate([pad, k[:, :, :S + 6]], 2),
                    mx.concatenate([pad, v[:, :, :S + 6]], 2), scale=D ** -0.5,
                    mask=(mx.arange(S + 13) >= 7)[None, None, None])
        assert mx.array_equal(one, left).item()
        kb = mx.concatenate([k[:, :, :S + 6], mx.random.normal((2, 1, S + 6, D)).astype(dt)])
        vb = mx.concatenate([v[:, :, :S + 6], mx.random.normal((2, 1, S + 6, D)).astype(dt)])
        qb = mx.concatenate([q[:, :, 5:6], mx.random.normal((2, 2, 1, D)).astype(dt)])
        assert mx.array_equal(one, sdpa(qb, kb, vb, scale=D ** -0.5)[:1]).item()
        h = mx.random.normal((33, 64)).astype(dt)      # row-wise: RMSNorm, the logits' softmax
        norm, lse = mx.fast.rms_norm(h, w[0], 1e-6), mx.logsumexp(h, axis=-1, keepdims=True)
        assert all(mx.array_equal(mx.fast.rms_norm(h[:m], w[0], 1e-6), norm[:m]).item()
                   and mx.array_equal(mx.logsumexp(h[:m], axis=-1, keepdims=True),
                                      lse[:m]).item() for m in (1, 2, 7))
    q, k, v = (mx.random.normal(s) for s in ((1, 2, 1, 32), (1, 1, 40, 32), (1, 1, 40, 32)))
    a = sdpa(q, k, v, scale=32 ** -0.5)
    rolled = [sdpa(q, mx.roll(k, r, 2), mx.roll(v, r, 2), scale=32 ** -0.5) for r in range(1, 8)]
    assert not all(mx.array_equal(a, b).item() for b in rolled)


def test_a_draft_models_requests_keep_their_logits_among_any_rows():
    """With a draft model in this mode its requests run alone beside the batch (their drafts
    never depend on other rows): a greedy one among 7 other rows of random lengths gives the
    tokens and logprobs of plain decoding alone, drafts accepted; a seeded rejection-sampled
    one (its drafts become its tokens) repeats among other rows; both counted as alone."""
    model, tok = _load("llama")
    draft, _ = _load("llama", "q4")
    rng = random.Random(5)
    target = (ids(rng, 5, 5) * 9)[:44]
    plain = drive(_engine(model, tok, max_batch=1, deterministic=True), [(0, target, GREEDY)])[0]
    greedy = SamplingParams(max_tokens=14, temperature=0.0, num_draft_tokens=3)
    sampled = SamplingParams(max_tokens=14, temperature=0.8, seed=3, num_draft_tokens=3,
                             spec_sampling="rejection")
    runs = []
    for others in (0, 7, 7):
        plan = [(rng.randint(0, 6), ids(rng, 1, 60),      # (batch rows: no drafts)
                 SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, use_draft=False))
                for _ in range(others)] + [(2, target, greedy), (3, target, sampled)]
        plan.sort(key=lambda p: p[0])
        eng = _engine(model, tok, max_batch=8, deterministic=True, draft_model=draft)
        got = drive(eng, plan)
        g = next(i for i, p in enumerate(plan) if p[2] is greedy)
        s = next(i for i, p in enumerate(plan) if p[2] is sampled)
        assert same(got[g], plain)
        runs.append(got[s])
        assert eng.stats()["solo_reasons"].get("draft_model") == 2
        assert eng.stats()["speculation"]["draft"]["accepted"] > 0
    assert len(runs[0][0]) == 14 and same(runs[0], runs[1]) and same(runs[1], runs[2])
