"""Speculating rows on the fast runner (L3): the verify step as one fast step
(engine.fast.slots.SlotPool.verify, engine.fast.decode.FastStep with `crow`).

A speculating row's token and drafts go through the fast step as call rows that share the row's
slot, each at its own column, each attending to the ones before it (every row's keys are written
before any row attends); then the drafts not kept leave the slot (`SlotPool.rewind`). On the CPU
the fast step is the same math as the L1 forward in stock MLX, one row at a time, so each
position's logits equal those of single fast steps bit for bit (`mx.array_equal`), and every
row's tokens and logprob vectors equal the fast runner's without speculation — prompt lookup
and draft-model rows, with rows without speculation sharing the step. On a GPU the one kernel
computes each call row as a row of a plain step of that many rows; experiments/fast_verify_gpu.py
checks it there. Negative controls: without the rewind, or with a verify's rows all at one column,
the tokens or logits differ.
"""

import random

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.fast.apply import fast_step_for
from engine.fast.slots import SlotPool
from engine.levers import parse_spec, resolve
from parity.fixtures.models import ensure_fixture
from spec_rows import DRAFTS, PROMPTS, draft_pair, drive

FAST = parse_spec("l3")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return engine.load(str(ensure_fixture(request.param, "float32")))


def _pool(m, step, prompts):
    return SlotPool.of_prompts(step, m, prompts)


FEED = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]


def _verify_against_single_steps(m, lengths, break_columns=False, monkeypatch=None):
    """(verify logits [B, T, V], single steps' logits [B, T, V], the verified pool, prompts)."""
    step = fast_step_for(m, FAST)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 900) for _ in range(n)] for n in (7, 12, 3)]
    a = _pool(m, step, prompts)
    seq = mx.stack([a(mx.array([f[j] for f in FEED], dtype=mx.int32)) for j in range(4)], axis=1)
    b = _pool(m, step, prompts)
    if break_columns:               # (the control: every call row of a row at its first column)
        real = step.__call__

        def flat(self, tokens, pos, active, keys, values, crow=None):
            if crow is not None:
                pos = mx.array([b.held[int(s)] for s in crow.tolist()], dtype=mx.int32)
            return real(tokens, pos, active, keys, values, crow=crow)
        monkeypatch.setattr(type(step), "__call__", flat)
    return b.verify(mx.array(FEED, dtype=mx.int32), lengths), seq, b, prompts


@pytest.mark.parametrize("lengths", [[4, 1, 3], [4, 4, 4], [1, 1, 2]])
def test_each_verified_position_has_a_single_steps_logits(model, lengths):
    m, _ = model
    v, seq, pool, prompts = _verify_against_single_steps(m, lengths)
    assert v.shape[:2] == (3, 4)
    for i, n in enumerate(lengths):
        for j in range(4):          # (past a row's own tokens: its last position's again)
            assert mx.array_equal(v[i, j], seq[i, min(j, n - 1)]).item()
    assert pool.held[:3] == [len(p) + 4 for p in prompts]
    assert fast_step_for(m, FAST).stats.verify_steps >= 1


def test_a_verify_runs_exactly_its_call_rows_while_one_kernel_call_takes_them(model, monkeypatch):
    """5 call rows: run as 5 where one call of the one-kernel step takes up to 8 rows (0.6.1;
    a bucket of 8 cost 1.9 plain steps on the 1B, 1.4 exact), as the bucket of 8 where it takes
    4 or where there is no one kernel (the CPU's own case); same logits every way."""
    m, _ = model
    step = fast_step_for(m, FAST)
    real, seen = type(step).__call__, []

    def spy(self, tokens, *a, **kw):
        seen.append(tokens.shape[0])
        return real(self, tokens, *a, **kw)
    monkeypatch.setattr(type(step), "__call__", spy)
    lengths = [2, 1, 2]
    for mega_rows, want in ((8, 5), (4, 8), (0, 8)):
        monkeypatch.setattr(step, "mega_rows", mega_rows)
        seen.clear()
        v, seq, _, _ = _verify_against_single_steps(m, lengths)
        assert seen[-1] == want            # (the verify: the last call)
        for i, n in enumerate(lengths):
            for j in range(n):
                assert mx.array_equal(v[i, j], seq[i, j]).item()


def test_rewind_after_a_verify_leaves_the_kept_tokens_only(model):
    """Row 0 keeps 2 of its 3 drafts, row 1 none, row 2 all: the next plain step's logits equal
    those of a pool fed only the kept tokens."""
    m, _ = model
    _, _, pool, prompts = _verify_against_single_steps(m, [4, 1, 3])
    kept = [3, 1, 3]
    pool.rewind([4 - k for k in kept])
    nxt = pool(mx.array([40, 41, 42], dtype=mx.int32))
    ref = _pool(m, fast_step_for(m, FAST), [p + f[:k] for p, f, k in zip(prompts, FEED, kept)])
    want = ref(mx.array([40, 41, 42], dtype=mx.int32))
    assert mx.array_equal(nxt, want).item()


def test_negative_control_a_verify_at_one_column_differs(model, monkeypatch):
    m, _ = model
    v, seq, _, _ = _verify_against_single_steps(m, [4, 4, 4], break_columns=True,
                                                monkeypatch=monkeypatch)
    assert v.shape == seq.shape and not mx.array_equal(v, seq).item()


def _lookup_params(i, lookup):
    if i == 1:
        return SamplingParams(max_tokens=30, temperature=0.8, seed=7)
    n = {0: 1, 2: 2, 3: 1}.get(i, 0) if lookup else 0
    return SamplingParams(max_tokens=30, temperature=0.0, prompt_lookup=n, num_draft_tokens=5)


def _lookup_batch(m, tok, lookup):
    eng = Engine(m, tok, max_batch=len(PROMPTS), keep_logprob_arrays=True, levers=FAST)
    rids = [eng.submit(p, _lookup_params(i, lookup)) for i, p in enumerate(PROMPTS)]
    return drive(eng, rids), eng


def _same(got, ref):
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert all(mx.array_equal(x, y).item() for (_, a), (_, b) in zip(got, ref) for x, y in zip(a, b))


def test_lookup_rows_on_the_fast_runner_keep_every_rows_tokens_and_logprobs(model):
    m, tok = model
    ref, _ = _lookup_batch(m, tok, False)
    got, eng = _lookup_batch(m, tok, True)
    _same(got, ref)
    st = eng.stats()
    assert eng.lookup_rows and st["lanes"] == {"batch": len(PROMPTS), "solo": 0}
    assert st["speculation"]["lookup"]["accepted"] > 0
    assert eng.fast_step.stats.verify_steps > 0


def test_negative_control_rejected_lookups_left_in_the_slot_change_the_tokens(monkeypatch):
    m, tok = engine.load(str(ensure_fixture("llama", "float32")))
    ref, _ = _lookup_batch(m, tok, False)
    monkeypatch.setattr(SlotPool, "rewind", lambda self, drop: None)
    got, eng = _lookup_batch(m, tok, True)
    look = eng.stats()["speculation"]["lookup"]
    assert look["accepted"] < look["drafted"]        # (there were drafts to take back)
    assert [t for t, _ in got] != [t for t, _ in ref]


@pytest.fixture(scope="module", params=list(DRAFTS))
def pair(request):
    return draft_pair(request.param)


def _draft_params(i, draft):
    if i == 1:
        return SamplingParams(max_tokens=30, temperature=0.8, seed=7, use_draft=False)
    return SamplingParams(max_tokens=30, temperature=0.0, use_draft=draft and i != 4,
                          num_draft_tokens={0: 3, 2: 4, 3: 2}.get(i, 3))


@pytest.mark.parametrize("draft_tier", ["l1", "l3"])
def test_draft_rows_on_the_fast_runner_keep_every_rows_tokens_and_logprobs(pair, draft_tier):
    """The target on the fast runner verifies; the draft steps on its own runner (l1: the draft
    model's forward over batched caches; l3: a fast step of its own)."""
    m, tok, d = pair

    def run(draft):
        eng = Engine(m, tok, max_batch=len(PROMPTS), keep_logprob_arrays=True, levers=FAST,
                     draft_model=d, draft_levers=resolve("l3") if draft_tier == "l3" else None)
        rids = [eng.submit(p, _draft_params(i, draft)) for i, p in enumerate(PROMPTS)]
        return drive(eng, rids), eng
    ref, _ = run(False)
    got, eng = run(True)
    _same(got, ref)
    st = eng.stats()
    assert eng.draft_rows and st["lanes"] == {"batch": len(PROMPTS), "solo": 0}
    assert st["speculation"]["draft"]["accepted"] > 0
    assert st["speculation"]["draft_runner"] == ("fast" if draft_tier == "l3" else "l1")
    assert eng.fast_step.stats.verify_steps > 0


def test_served_on_the_fast_runner_speculating_requests_are_batch_rows():
    """engine-serve --tier l3 with --draft-model or --prompt-lookup: two concurrent greedy
    completions answer what the same server without speculation answers, as rows of the batch
    (none runs alone), with drafts kept and verify steps on the fast runner."""
    import threading

    import httpx

    from tests.server.srv_helpers import start_server, stop_server
    path, draft = (str(ensure_fixture("llama", d)) for d in ("bfloat16", "q4"))
    prompts = ["one two three one two three one two", "the cat sat on the mat, the cat sat"]
    answers = {}
    for name, kw in (("plain", {}), ("draft", {"draft_model": draft, "draft_tier": "l3"}),
                     ("lookup", {"prompt_lookup": 2})):
        s = start_server(path, levers=FAST, num_draft_tokens=3, prompt_cache_bytes=0, batch=4, **kw)
        try:
            out = [None, None]

            def ask(i):
                r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                    "prompt": prompts[i], "max_tokens": 24, "temperature": 0})
                out[i] = (r.status_code, r.json()["choices"][0]["text"])
            ts = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            answers[name] = out
            st = httpx.get(s.url + "/stats").json()
            assert st["batch"]["lanes"]["serial"] == 0
            if name != "plain":
                assert st["speculation"][name]["drafted"] > 0
                assert s.state.engine.fast_step.stats.verify_steps > 0
        finally:
            stop_server(s)
    assert all(code == 200 for code, _ in answers["plain"])
    assert answers["draft"] == answers["plain"] == answers["lookup"]


def test_the_lookup_default_k_is_4_on_the_fast_runner(monkeypatch):
    """engine-serve --prompt-lookup N without --num-draft-tokens: K 15 on CUDA for the L1 rows
    (a verify's query padded to 16 positions anyway), 4 for rows on the fast runner (a verify
    there costs more the more positions it has) and off CUDA."""
    from engine.models import bucketed_sdpa
    from server.cli import config_from_args, parser

    def k(*flags):
        return config_from_args(parser().parse_args(["--prompt-lookup", "2", *flags])).num_draft_tokens
    assert k() == 4 and k("--tier", "l3") == 4
    monkeypatch.setattr(bucketed_sdpa, "on_cuda", lambda device=None: True)
    assert k() == 15 and k("--tier", "l3") == 4 and k("--tier", "l3", "--num-draft-tokens", "9") == 9
