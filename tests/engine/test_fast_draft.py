"""The draft model's steps on the fast runner (engine.step.fast_draft.FastDraftBatch).

With `draft_levers` (a fast-decode tier) the batch rows' drafts come from the fast runner's
step over a slot pool instead of the draft model's own forward over batched caches. The
model still verifies every draft, so every row's tokens and logprob vectors equal those of
the same batch without a draft model (here on the CPU, where the verify forward gives each
position a single step's logits: see test_batch_draft.py). On the CPU the fast step is the
same math in stock MLX, so its drafts are also the draft model's own: each proposal equals
the draft model's greedy tokens after the row's context, alone, which holds only if the
pool's KV is right after every rejected draft (`SlotPool.rewind`) and every row's catch-up;
a negative control that leaves the rejected drafts in the pool proposes other tokens.
"""

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.fast.apply import fast_step_for
from engine.fast.slots import SlotPool
from engine.kv.batch_cache import batch_caches
from engine.levers import resolve
from engine.step.batch_draft import DraftBatch
from engine.step.fast_draft import FastDraftBatch
from parity.fixtures.models import ensure_fixture
from spec_rows import DRAFTS, PROMPTS, REPEATS, draft_alone, draft_pair, spy_proposals



@pytest.fixture(scope="module", params=list(DRAFTS))
def pair(request):
    return (*draft_pair(request.param), request.param)


def _params(i):
    """Rows 0, 2, 3 greedy with the draft (K 3, 4, 2); row 1 sampled with a seed and row 4
    greedy, both without it."""
    if i == 1:
        return SamplingParams(max_tokens=30, temperature=0.8, seed=7, use_draft=False)
    return SamplingParams(max_tokens=30, temperature=0.0, use_draft=i != 4,
                          num_draft_tokens={0: 3, 2: 4, 3: 2}.get(i, 3))


def _run(m, tok, draft, draft_levers=None, stagger=False):
    """Every prompt on one Engine (with `stagger`, the last two join 5 steps late): tokens
    and logprob vectors per request, and the engine."""
    eng = Engine(m, tok, max_batch=len(PROMPTS), keep_logprob_arrays=True, draft_model=draft,
                 draft_levers=draft_levers)
    late = PROMPTS[3:] if stagger else []
    rids = [eng.submit(p, _params(i)) for i, p in enumerate(PROMPTS) if p not in late]
    toks, lps, steps = {}, {}, 0
    while eng.has_unfinished() or late:
        if late and steps == 5:
            rids += [eng.submit(p, _params(PROMPTS.index(p))) for p in late]
            late = []
        for o in eng.step():
            assert o.error is None
            toks[o.request_id] = toks.get(o.request_id, []) + o.token_ids
            lps[o.request_id] = lps.get(o.request_id, []) + o.logprob_arrays
        steps += 1
    return [toks[r] for r in rids], [lps[r] for r in rids], eng


@pytest.mark.parametrize("stagger", [False, True])
def test_fast_drafts_keep_every_rows_tokens_and_logprobs(pair, stagger):
    m, tok, d, family = pair
    ref, ref_lp, _ = _run(m, tok, None, stagger=stagger)
    got, got_lp, eng = _run(m, tok, d, resolve("l3"), stagger=stagger)
    assert got == ref and all(len(t) == 30 for t in got)
    assert all(mx.array_equal(x, y).item() for a, b in zip(got_lp, ref_lp) for x, y in zip(a, b))
    assert isinstance(eng._sched._decode.draft, FastDraftBatch)
    spec = eng.stats()["speculation"]
    assert spec["draft_runner"] == "fast" and spec["draft"]["accepted"] > 0
    # the draft's fast runner counts its own steps and traces (a served stall shows there)
    assert spec["draft_fast"]["steps"] > 0 and spec["draft_fast"]["traces"] >= 1
    assert eng._sched._decode.draft.pool.slots == []          # every row left: its slot freed


def test_fast_drafts_are_the_draft_models_own_on_the_cpu(pair, monkeypatch):
    """Each proposal equals the draft model's greedy tokens after the row's context, alone;
    some drafts are rejected (qwen3's `long` draft), so the rewinds are exercised."""
    m, tok, d, family = pair
    seen = spy_proposals(monkeypatch)
    _, _, eng = _run(m, tok, d, resolve("l3"), stagger=True)
    assert len(seen) > 10
    assert all(drafts == draft_alone(d, context, len(drafts)) for context, drafts in seen)
    spec = eng.stats()["speculation"]["draft"]
    if family == "qwen3":
        assert 0 < spec["accepted"] < spec["drafted"]


def test_negative_control_rejected_drafts_left_in_the_pool_change_the_drafts(monkeypatch):
    m, tok = engine.load(str(ensure_fixture("qwen3", "float32")))
    d, _ = engine.load(str(ensure_fixture("qwen3", "bfloat16", variant="long")))
    seen = spy_proposals(monkeypatch)
    monkeypatch.setattr(FastDraftBatch, "take_back", lambda self, drop: None)
    _, _, eng = _run(m, tok, d, resolve("l3"))
    spec = eng.stats()["speculation"]["draft"]
    assert spec["accepted"] < spec["drafted"]                  # (there were drafts to take back)
    assert any(drafts != draft_alone(d, context, len(drafts)) for context, drafts in seen)


def test_without_fast_levers_or_draft_the_draft_runs_as_before(pair):
    m, tok, d, family = pair
    eng = Engine(m, tok, max_batch=2, draft_model=d)
    assert type(eng._sched._decode.draft) is DraftBatch
    assert eng.stats()["speculation"]["draft_runner"] == "l1"
    assert eng.stats()["speculation"]["draft_fast"] is None
    assert Engine(m, tok, max_batch=2).stats()["speculation"]["draft_runner"] is None


def test_slot_pool_rewind_moves_a_rows_column_back():
    m, _ = engine.load(str(ensure_fixture("llama", "float32")))
    pool = SlotPool(fast_step_for(m, resolve("l3")), m)
    caches = m.make_cache()
    m(mx.array([[1, 2, 3]]), cache=caches)
    pool.extend(batch_caches([caches, _filled(m, [4, 5])]))
    first = pool(mx.array([7, 8], dtype=mx.int32))
    assert pool.held[:2] == [4, 3]
    pool.rewind([1, 0])
    assert pool.held[:2] == [3, 3]
    again = pool(mx.array([7, 9], dtype=mx.int32))       # row 0 recomputes its column 3
    assert mx.array_equal(again[0], first[0]).item()
    assert pool.held[:2] == [4, 4]


def _filled(m, tokens):
    caches = m.make_cache()
    m(mx.array([tokens]), cache=caches)
    return caches


def _long_run(m, tok, d, draft_levers, abort_at=None):
    """A 700-token prompt (the pool's columns grow past 512) drafting beside two short rows;
    with `abort_at`, the second short row is aborted after that many steps."""
    eng = Engine(m, tok, max_batch=4, keep_logprob_arrays=True, draft_model=d,
                 draft_levers=draft_levers)
    long = (list(range(3, 40)) * 20)[:700]
    params = SamplingParams(max_tokens=24, temperature=0.0, num_draft_tokens=3)
    rids = [eng.submit(long, params), eng.submit(REPEATS, params), eng.submit(PROMPTS[2], params)]
    toks, lps, steps = {}, {}, 0
    while eng.has_unfinished():
        if steps == abort_at:
            eng.abort(rids[2])
        for o in eng.step():
            toks[o.request_id] = toks.get(o.request_id, []) + o.token_ids
            lps[o.request_id] = lps.get(o.request_id, []) + o.logprob_arrays
        steps += 1
    return [toks.get(r, []) for r in rids], [lps.get(r, []) for r in rids], eng


def test_a_long_row_and_an_aborted_row(pair):
    """The pool grows its columns for a 700-token row and frees an aborted row's slot; the
    rows that finish give the tokens and logprobs of the draft's own forward (l1)."""
    m, tok, d, _ = pair
    ref, ref_lp, _ = _long_run(m, tok, d, None, abort_at=6)
    got, got_lp, eng = _long_run(m, tok, d, resolve("l3"), abort_at=6)
    assert got[:2] == ref[:2] and all(len(t) == 24 for t in got[:2]) and len(got[2]) < 24
    assert all(mx.array_equal(x, y).item() for a, b in zip(got_lp[:2], ref_lp[:2]) for x, y in zip(a, b))
    pool = eng._sched._decode.draft.pool
    assert pool.capacity >= 1024 and pool.slots == []


def _paused_run(m, tok, d, draft_levers, draft_max_rows, monkeypatch=None):
    """Two drafting rows (40 tokens), three plain ones (8 tokens) joining after 4 steps: with
    `draft_max_rows` 2 the two draft, drafting pauses while the five decode and resumes when
    the plain ones are done, ~8 tokens behind. Tokens and logprobs per request, the rows count
    of every step that drafted, and the engine."""
    eng = Engine(m, tok, max_batch=5, keep_logprob_arrays=True, draft_model=d,
                 draft_levers=draft_levers, draft_max_rows=draft_max_rows)
    drafting = SamplingParams(max_tokens=40, temperature=0.0, num_draft_tokens=3)
    plain = SamplingParams(max_tokens=8, temperature=0.0, use_draft=False)
    rids = {i: eng.submit(PROMPTS[i], drafting) for i in (0, 3)}
    drafted_at = []
    if monkeypatch is not None:             # (on top of spy_proposals' spy)
        real = eng._sched._decode.draft.propose.__func__

        def spy(self, rows, ys):
            real(self, rows, ys)
            if self.ran:
                drafted_at.append(len(rows))
        monkeypatch.setattr(type(eng._sched._decode.draft), "propose", spy)
    toks, lps, steps = {}, {}, 0
    while eng.has_unfinished():
        if steps == 4:
            rids.update({i: eng.submit(PROMPTS[i], plain) for i in (1, 2, 4)})
        for o in eng.step():
            toks[o.request_id] = toks.get(o.request_id, []) + o.token_ids
            lps[o.request_id] = lps.get(o.request_id, []) + o.logprob_arrays
        steps += 1
    order = [rids[i] for i in range(5)]
    return [toks[r] for r in order], [lps[r] for r in order], drafted_at, eng


@pytest.mark.parametrize("fast", [False, True])
def test_drafting_pauses_while_more_rows_decode(pair, monkeypatch, fast):
    """draft_max_rows 2: no drafts while five rows decode, drafts once two are left; every
    row's tokens and logprobs as without a draft model, and every proposal (the first after
    the pause included, its ~8 missed tokens caught up) the draft model's own greedy tokens."""
    m, tok, d, _ = pair
    levers = resolve("l3") if fast else None
    ref, ref_lp, _, _ = _paused_run(m, tok, None, None, None)
    seen = spy_proposals(monkeypatch)
    got, got_lp, drafted_at, eng = _paused_run(m, tok, d, levers, 2, monkeypatch)
    assert got == ref and [len(t) for t in got] == [40, 8, 8, 40, 8]
    assert all(mx.array_equal(x, y).item() for a, b in zip(got_lp, ref_lp) for x, y in zip(a, b))
    assert drafted_at and max(drafted_at) <= 2                  # no drafts beside the plain rows
    assert seen and all(drafts == draft_alone(d, context, len(drafts)) for context, drafts in seen)
    assert eng.stats()["speculation"]["draft"]["accepted"] > 0
    with pytest.raises(ValueError, match="draft_max_rows"):
        Engine(m, tok, max_batch=2, draft_model=d, draft_max_rows=0)


def test_negative_control_a_pause_that_forgets_the_tokens_changes_the_drafts(pair, monkeypatch):
    """Without `DraftBatch.pause` noting where each row stood, the draft resumes without the
    tokens handed out meanwhile: its proposals are no longer the draft model's own. (The
    fast draft catches those tokens up through the draft's own forward: `SlotPool.replace`.)"""
    m, tok, d, _ = pair
    replaced = []
    real_replace = SlotPool.replace
    monkeypatch.setattr(SlotPool, "replace", lambda self, i, rows: replaced.append(i) or real_replace(self, i, rows))
    seen = spy_proposals(monkeypatch)
    _paused_run(m, tok, d, resolve("l3"), 2)
    assert replaced and all(drafts == draft_alone(d, c, len(drafts)) for c, drafts in seen)
    seen.clear()
    monkeypatch.setattr(DraftBatch, "pause", lambda self: None)
    _paused_run(m, tok, d, resolve("l3"), 2)
    assert any(drafts != draft_alone(d, c, len(drafts)) for c, drafts in seen)
