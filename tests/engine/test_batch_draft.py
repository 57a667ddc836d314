"""Draft-model speculation as rows of the continuous batch (engine.step.batch_draft).

A greedy request on an Engine with a draft model is a batch row (not a request running alone):
each decode step the draft model proposes up to K tokens for every drafting row at once (its own
batched caches, prefilled with the row's prompt at its first decode step), and the batch's one
forward over [B, K + 1] verifies them as it verifies prompt-lookup rows (engine.step.batch_lookup);
the rejected and padded columns leave the target's KV and the draft's (`BatchKVCache.rewind`).

Where it is bit-identical, and where not: the tokens handed out are the target's argmax at every
position whatever the draft proposes, and on the CPU with full-attention layers (the llama and
qwen3 float32 fixtures here) a forward over several positions gives each position, of every row,
the logits a single step gives, so every row's tokens *and* logprob vectors equal those of the
same batch without the draft model (the rows that do not speculate, sampled seeded ones
included). Not on a GPU: matmul and attention kernels are chosen by shape, so the [B, K + 1]
verify forward rounds differently from a [B, 1] step, for the drafting rows and the rows sharing
their step; a nearly tied greedy choice can then flip (not tested here: no GPU). Sampled
requests with a draft model (mlx-lm's exact scheme or rejection sampling) still run alone on
the exact runner (engine.step.draft), as do greedy ones on the fast runner (L3) or max_batch 1.
"""

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.kv.batch_cache import BatchKVCache
from engine.levers import parse_spec
from engine.step.batch import BatchRequest, BatchScheduler
from engine.step.batch_draft import DraftBatch, RowDraft
from spec_rows import DRAFTS, draft_alone, draft_pair, run_row, spy_proposals

REPEATS = [5, 6, 7, 8, 9, 10, 11, 12] * 6
PROMPTS = [REPEATS, list(range(20, 50)), [3, 4, 5, 6, 3, 4, 5, 6, 3, 4] * 3,
           list(range(100, 140)) * 2, REPEATS[5:] + [1, 2]]
@pytest.fixture(scope="module", params=list(DRAFTS))
def pair(request):
    return draft_pair(request.param)


def _params(i, max_tokens=30):
    """Rows 0, 2, 3 greedy with the draft model (K 3, 4, 2), row 1 sampled with a seed and row 4
    greedy, both without it (use_draft=False: plain rows of the same steps)."""
    if i == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=7, use_draft=False)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, use_draft=i != 4,
                          num_draft_tokens={0: 3, 2: 4, 3: 2}.get(i, 3))


def _batch(m, tok, draft):
    """All PROMPTS in one batch; per request its tokens, logprob vectors and last output, the
    most events one scheduler step gave each row, and the engine."""
    eng = Engine(m, tok, max_batch=len(PROMPTS), keep_logprob_arrays=True, draft_model=draft)
    rids = [eng.submit(p, _params(i)) for i, p in enumerate(PROMPTS)]
    per_step, real = {}, eng._sched.step

    def spy():
        evs = real()
        for uid in {ev.uid for ev in evs}:
            per_step[uid] = max(per_step.get(uid, 0), sum(ev.uid == uid for ev in evs))
        return evs
    eng._sched.step = spy
    toks, lps, last = {r: [] for r in rids}, {r: [] for r in rids}, {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None
            toks[o.request_id] += o.token_ids
            lps[o.request_id] += o.logprob_arrays
            last[o.request_id] = o
    most = [per_step.get(i, 0) for i in range(len(rids))]   # (row uids: 0.. in submit order)
    return [toks[r] for r in rids], [lps[r] for r in rids], [last[r] for r in rids], most, eng


def test_draft_rows_give_the_batch_tokens_and_logprobs_in_fewer_steps(pair):
    m, tok, d = pair
    ref, ref_lp, _, ref_most, _ = _batch(m, tok, None)
    got, got_lp, last, most, eng = _batch(m, tok, d)
    assert got == ref and all(len(t) == 30 for t in got)
    assert all(mx.array_equal(x, y).item() for a, b in zip(got_lp, ref_lp) for x, y in zip(a, b))
    st = eng.stats()
    assert st["lanes"] == {"batch": 5, "solo": 0} and st["solo_reasons"] == {}
    # the drafting rows (0, 2, 3) handed out several tokens in one step; the others one a step
    assert ref_most == [1] * 5 and most[1] == most[4] == 1
    assert max(most[i] for i in (0, 2, 3)) > 1
    spec = st["speculation"]
    assert 0 < spec["draft"]["accepted"] < spec["draft"]["drafted"]      # some rejected
    assert spec["lookup"]["drafted"] == 0 and spec["accepted"] == spec["draft"]["accepted"]
    recent = spec["recent"]
    assert sorted(r["request_id"] for r in recent) == ["0", "2", "3"]
    assert {r["source"] for r in recent} == {"draft"}
    assert all(r["forwards"] < 30 for r in recent)         # 30 tokens in fewer verify steps
    for key in ("accepted", "drafted", "forwards"):
        assert sum(r[key] for r in recent) == spec["draft"][key]
    # per request: the same counts on its last output, none on the rows that did not draft
    by_id = {r["request_id"]: r for r in recent}
    for i, o in enumerate(last):
        if i in (1, 4):
            assert o.speculation is None
        else:
            assert o.speculation == {k: by_id[str(i)][k] for k in o.speculation}
    assert eng._sched._decode.draft.caches == []           # every row left: freed


def _proposals(monkeypatch, m, tok, d):
    """Every proposal of the batch's draft: (the row's tokens before it, its drafts)."""
    seen = spy_proposals(monkeypatch)
    got, _, _, _, eng = _batch(m, tok, d)
    return got, seen, eng.stats()["speculation"]["draft"]


def test_the_batched_draft_proposes_what_the_draft_alone_does(pair, monkeypatch):
    """Each proposal equals the draft model's greedy continuation of the row's tokens run alone:
    its batched caches hold exactly the row's tokens (joined, fed, rewound, filtered)."""
    m, tok, d = pair
    _, seen, _ = _proposals(monkeypatch, m, tok, d)
    assert len(seen) > 20
    for context, drafts in seen:
        assert drafts == draft_alone(d, context, len(drafts))


def test_negative_controls_without_the_rewinds(pair, monkeypatch):
    """The draft's rewind made a no-op: the rejected drafts stay in its caches, its proposals
    are no longer the draft alone's (the tokens still equal, as the target verifies every
    draft). The target's too (`BatchKVCache.rewind` a no-op, both models): the tokens change."""
    m, tok, d = pair
    ref, _, _, _, _ = _batch(m, tok, None)
    with monkeypatch.context() as mp:
        mp.setattr(DraftBatch, "take_back", lambda self, drop: None)
        got, seen, counts = _proposals(mp, m, tok, d)
    assert got == ref and counts["drafted"] > counts["accepted"]
    assert any(drafts != draft_alone(d, ctx, len(drafts)) for ctx, drafts in seen)
    monkeypatch.setattr(BatchKVCache, "rewind", lambda self, drop: None)
    got, _, _, _, _ = _batch(m, tok, d)
    assert got != ref


def _one(m, tok, d, prompt, params, stop_ids=(), cache_bytes=0):
    """One draft row beside a plain greedy row; its tokens, finish reason, the tokens of its
    last step it did not hand out, the tokens it got from each decode step, and the engine."""
    eng = Engine(m, tok, max_batch=4, draft_model=d,
                 prompt_cache=engine.PromptCache(cache_bytes) if cache_bytes else None)
    eng.eos = eng.eos | set(stop_ids)
    return (*run_row(eng, prompt, params, filler={"use_draft": False}), eng)


def test_a_stop_inside_an_accepted_run_ends_the_row_there(pair):
    """max_tokens, a stop string and EOS landing inside a step's run of accepted drafts: the row
    hands out nothing after it and ends as the same request without the draft model does; the
    KV it leaves to the prompt cache answers a follow-up as a cold engine does."""
    m, tok, d = pair
    prompt = PROMPTS[2]
    spec = dict(temperature=0.0, num_draft_tokens=4)
    full, _, _, runs, _ = _one(m, tok, d, prompt, SamplingParams(max_tokens=30, **spec))
    start = next(sum(runs[:i]) for i, n in enumerate(runs) if i and n >= 3)
    # a stop string that completes at the first token of a run (the output's text drops one
    # leading space)
    stop = tok.decode(full[:start + 1]).lstrip()
    eos = max(set(full), key=full.index)          # the token that first shows up last
    cases = [(dict(max_tokens=start + 2), ()), (dict(max_tokens=30, stop=[stop]), ()),
             (dict(max_tokens=30), (eos,))]
    for kw, stop_ids in cases:
        want, why, _, _, _ = _one(m, tok, None, prompt, SamplingParams(temperature=0.0, **kw),
                                  stop_ids=stop_ids)
        got, reason, dropped, _, eng = _one(m, tok, d, prompt, SamplingParams(**kw, **spec),
                                            stop_ids=stop_ids, cache_bytes=10**8)
        assert (got, reason) == (want, why) and got == full[:len(got)]
        assert reason == ("length" if "stop" not in kw and not stop_ids else "stop")
        if "stop" in kw:      # the tokens verified after it in that step were not handed out
            assert dropped > 0
            follow = prompt + got + [5, 6, 7]
            eng.submit(follow, SamplingParams(max_tokens=12, temperature=0.0))
            warm, cached = [], 0
            while eng.has_unfinished():
                for o in eng.step():
                    warm += o.token_ids
                    cached = max(cached, o.cached_tokens)
            cold, _, _, _, _ = _one(m, tok, None, follow,
                                    SamplingParams(max_tokens=12, temperature=0.0))
            assert cached > len(prompt) and warm == cold


def test_the_scheduler_frees_a_rows_draft_caches_when_it_leaves(pair):
    """BatchScheduler with a draft_model (its own max_tokens): the draft's caches hold the
    drafting rows only, lose a row when it leaves and are freed with the last; the KV a row
    hands back holds its prompt and its tokens, not the drafts verified after its end."""
    m, tok, d = pair
    sched = BatchScheduler(m, eos_token_ids=(), draft_model=d)
    draft = sched._decode.draft
    a = sched.submit(BatchRequest(REPEATS, max_tokens=30, return_cache=True, draft=RowDraft(4)))
    b = sched.submit(BatchRequest(PROMPTS[2], max_tokens=9, return_cache=True, draft=RowDraft(4)))
    c = sched.submit(BatchRequest(PROMPTS[1], max_tokens=20))
    evs, sizes = [], []
    while sched.has_work():
        evs += sched.step()
        sizes.append((len(draft.rows), sched.decoding))
    assert (2, 3) in sizes and (1, 2) in sizes and sizes[-1] == (0, 0)
    assert draft.caches == [] and draft.nbytes == 0 and sched.kv_nbytes() == 0
    for u, p, n in ((a, REPEATS, 30), (b, PROMPTS[2], 9), (c, PROMPTS[1], 20)):
        mine = [e for e in evs if e.uid == u]
        assert len(mine) == n and mine[-1].finish_reason == "length"
        if u != c:
            assert mine[-1].caches[0].offset == len(p) + n
    with pytest.raises(ValueError, match="no draft_model"):
        BatchScheduler(m).submit(BatchRequest(REPEATS, draft=RowDraft(2)))
    with pytest.raises(ValueError, match="neither grammars nor built-in"):
        sched.submit(BatchRequest(REPEATS, draft=RowDraft(2),
                                  logits_processors=[lambda toks, lg: lg]))


def test_deterministic_mode_and_max_batch_1_run_draft_requests_alone(pair):
    """A draft-model request runs alone on the exact runner in deterministic mode or with
    max_batch 1 (a rejection-sampled one is a batch row: test_rejection_sampling.py); on the
    fast runner (L3) it is a row since 0.6.0 (tests/engine/test_fast_verify.py)."""
    m, tok, d = pair
    assert Engine(m, tok, max_batch=4, draft_model=d, levers=parse_spec("l3")).draft_rows
    cases = [({"deterministic": True}, dict(temperature=0.0)),
             ({"max_batch": 1}, dict(temperature=0.0))]
    for kw, params in cases:
        eng = Engine(m, tok, draft_model=d, **{"max_batch": 4, **kw})
        eng.submit(REPEATS, SamplingParams(max_tokens=6, **params))
        while eng.has_unfinished():
            eng.step()
        st = eng.stats()
        assert st["solo_reasons"] == {"draft_model" if eng.max_batch > 1 else "max_batch=1": 1}
        assert st["speculation"]["draft"]["forwards"] > 0
    assert Engine(m, tok, max_batch=4, draft_model=d).draft_rows


def test_a_long_prompts_draft_prefill_is_spread_over_steps(pair, monkeypatch):
    """A drafting row whose prompt is longer than the scheduler's prefill_step_size fills its
    draft caches a chunk a step (the joining rows together at most prefill_step_size tokens a
    step) while the other rows decode, drafts only once they hold its tokens (its proposals are
    the draft alone's), and every row's tokens equal the same scheduler's without a draft model.
    Negative control: with one catch-up step allowed to feed a whole prompt, the bound fails."""
    m, tok, d = pair
    long = list(range(100, 140)) * 3                               # 120 tokens
    step = 16

    def run(draft, budget=step):
        sched = BatchScheduler(m, eos_token_ids=(), draft_model=draft, prefill_step_size=step)
        fed, seen = [], []
        if draft is not None:
            sched._decode.draft.prefill_step_size = budget
            real_catch = DraftBatch._catch_up

            def catch(self, new):
                calls, model = [], self.model

                class Counted:
                    make_cache = model.make_cache

                    def __call__(self, x, cache=None):
                        calls.append(x.shape[1])
                        return model(x, cache=cache)
                self.model = Counted()
                try:
                    real_catch(self, new)
                finally:
                    self.model = model
                fed.append(sum(calls))
            monkeypatch.setattr(DraftBatch, "_catch_up", catch)
            seen = spy_proposals(monkeypatch)
        spec = (lambda k: RowDraft(k)) if draft is not None else (lambda k: None)
        uids = [sched.submit(BatchRequest(PROMPTS[1], max_tokens=40, draft=spec(3))),
                sched.submit(BatchRequest(PROMPTS[2], max_tokens=40)),
                sched.submit(BatchRequest(long, max_tokens=40, draft=spec(3)))]
        evs, joining_while_decoding = [], 0
        while sched.has_work():
            evs += sched.step()
            if draft is not None and sched._decode.draft.joining and sched.decoding > 1:
                joining_while_decoding += 1
        monkeypatch.undo()
        toks = [[e.token for e in evs if e.uid == u] for u in uids]
        return toks, fed, seen, joining_while_decoding

    ref, _, _, _ = run(None)
    got, fed, seen, overlap = run(d)
    assert got == ref and all(len(t) == 40 for t in got)
    assert max(fed) <= step and sum(f > 0 for f in fed) >= len(long) // step
    assert overlap >= 3                       # the long row filled up while the others decoded
    assert any(len(ctx) > len(long) for ctx, _ in seen)    # and then drafted
    for ctx, drafts in seen:
        assert drafts == draft_alone(d, ctx, len(drafts))
    _, fed_all, _, _ = run(d, budget=10 ** 6)                # (one step feeds everything)
    assert max(fed_all) > step


def _sampled(m, tok, draft, n=4):
    """n seeded sampled requests (temperature 0.2; the last without the draft model), one
    greedy drafting row beside them: each request's tokens and logprob vectors, and the stats."""
    eng = Engine(m, tok, max_batch=n + 1, keep_logprob_arrays=True, draft_model=draft)
    params = [SamplingParams(max_tokens=24, temperature=0.2, seed=11 + i, use_draft=i < n - 1,
                             num_draft_tokens=3) for i in range(n)]
    params.append(SamplingParams(max_tokens=24, temperature=0.0, num_draft_tokens=3))
    rids = [eng.submit(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]
    toks, lps = {r: [] for r in rids}, {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None
            toks[o.request_id] += o.token_ids
            lps[o.request_id] += o.logprob_arrays
    return [toks[r] for r in rids], [lps[r] for r in rids], eng.stats()


def test_sampled_draft_rows_give_the_seeded_batchs_tokens(pair, monkeypatch):
    """Seeded sampled requests with the draft model are rows of the batch (mlx-lm's scheme: a
    draft is kept when the row's own draw at its position equals it). Each later position is
    drawn with the row's next key only when the draft before it was kept, so every row's tokens
    and logprob vectors equal the same seeded batch's without a draft model, while drafts are
    kept. Negative control: drawing every position's key up front (keys spent on positions after
    a rejected draft) changes the tokens."""
    from engine.step import batch_lookup as BL
    m, tok, d = pair
    ref, ref_lp, _ = _sampled(m, tok, None)
    got, got_lp, st = _sampled(m, tok, d)
    assert st["solo_reasons"] == {}
    assert got == ref and all(len(t) == 24 for t in got)
    for a, b in zip(got_lp, ref_lp):
        assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    assert st["speculation"]["draft"]["accepted"] > 0
    assert st["speculation"]["draft"]["drafted"] > st["speculation"]["draft"]["accepted"]

    def eager(r, drafts, best, first, lp):
        if r.sampler is BL.greedy:
            return real(r, drafts, best, first, lp)
        draws = [first] + [r.sample(lp[a][None]).item() for a in range(1, len(drafts) + 1)]
        ok = 0
        while ok < len(drafts) and draws[ok] == drafts[ok]:
            ok += 1
        return ok, draws[ok]
    real = BL.accepted
    monkeypatch.setattr(BL, "accepted", eager)
    bad, _, _ = _sampled(m, tok, d)
    assert bad != ref


def test_a_seeded_rejection_row_repeats_among_other_rows(pair):
    """A rejection-sampled row's drafts become its tokens, so its draws must not depend on the
    other rows: it draws only its own drafts (not the most any row wants this step) and its
    draft prefill never waits for the others'. Seeded, it gives the same tokens alone and among
    greedy drafting rows that want more drafts and have long prompts to catch up."""
    m, tok, d = pair
    x = SamplingParams(max_tokens=20, temperature=0.9, seed=9, spec_sampling="rejection",
                       num_draft_tokens=2)

    def run(others):
        eng = Engine(m, tok, max_batch=5, draft_model=d, prefill_step_size=16)
        eng.eos = set()
        for p in others:
            eng.submit(p, SamplingParams(max_tokens=30, temperature=0.0, num_draft_tokens=4))
        rid = eng.submit(PROMPTS[1], x)
        out = []
        while eng.has_unfinished():
            for o in eng.step():
                assert o.error is None
                if o.request_id == rid:
                    out += o.token_ids
        return out, eng.stats()
    alone, _ = run([])
    among, st = run([list(range(100, 140)) * 3, REPEATS, PROMPTS[3]])
    assert len(alone) == 20 and among == alone
    assert st["solo_reasons"] == {} and st["speculation"]["draft"]["drafted"] > 0
