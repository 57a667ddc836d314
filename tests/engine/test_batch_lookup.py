"""Prompt-lookup speculation as rows of the continuous batch (engine.step.batch_lookup).

A request with prompt lookup (greedy, or sampled since 0.5.3) is a batch row (not a request running alone): each
decode step it drafts from its own prompt and output, and one forward over [B, K + 1] verifies
every row's draft while the rows without speculation (greedy or sampled) take their one token
from position 0 of the same forward; the rejected and padded columns are then taken back from
each row's KV (`BatchKVCache.rewind`).

Where it is bit-identical, and where not: on the CPU with full-attention layers (the llama and
qwen3 fixtures here, float32 and bfloat16) a forward over several positions gives each
position, of every row, the logits a single step gives (the stock wheel's kernels compute each
row and position independently, and masked columns contribute exact zeros), so every row's
tokens *and* logprob vectors equal those of the same batch without speculation, sampled seeded
rows included. Not on a GPU: matmul and attention kernels are chosen by shape, so a
[B, K + 1] forward rounds differently from a [B, 1] one, for the speculating rows and for the
rows that share their step; a nearly tied greedy choice can then flip (not tested here: no
GPU). Sliding-window models (Gemma 3/4) never get here: their rings cannot be trimmed back
and a verify forward reads the window in another order, so prompt lookup is refused there
(or, in deterministic mode, runs alone); on the fast runner (L3) a lookup request is a row
verified by the fast step (tests/engine/test_fast_verify.py).
"""

import functools

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.kv.batch_cache import BatchKVCache
from engine.levers import parse_spec
from engine.step.batch import BatchRequest, BatchScheduler
from engine.step.batch_lookup import RowLookup
from parity.fixtures.models import ensure_fixture
from spec_rows import PROMPTS, REPEATS, drive, run_row



@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return engine.load(str(ensure_fixture(request.param, "float32")))


def _params(i, lookup, max_tokens=30):
    """Rows 0, 2, 3 greedy (with lookup: ngram 1, 2, 1), row 1 sampled with a seed, row 4
    greedy without lookup."""
    if i == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=7)
    n = {0: 1, 2: 2, 3: 1}.get(i, 0) if lookup else 0
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_lookup=n,
                          num_draft_tokens=5)


def _batch(m, tok, lookup, **kw):
    """All PROMPTS in one batch; per request its tokens and logprob vectors, the most events
    one scheduler step gave it, and the engine."""
    eng = Engine(m, tok, max_batch=len(PROMPTS), keep_logprob_arrays=True, **kw)
    rids = [eng.submit(p, _params(i, lookup)) for i, p in enumerate(PROMPTS)]
    per_step = {}
    sched = eng._sched
    real = sched.step

    def spy():
        evs = real()
        count = {}
        for ev in evs:
            count[ev.uid] = count.get(ev.uid, 0) + 1
        for uid, n in count.items():
            per_step[uid] = max(per_step.get(uid, 0), n)
        return evs
    sched.step = spy
    toks, lps = {r: [] for r in rids}, {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.token_ids
            lps[o.request_id] += o.logprob_arrays
    most = [per_step.get(i, 0) for i in range(len(rids))]   # (row uids: 0.. in submit order)
    return [toks[r] for r in rids], [lps[r] for r in rids], most, eng


def test_lookup_rows_give_the_batch_tokens_and_logprobs_in_fewer_steps(model):
    m, tok = model
    ref, ref_lp, ref_most, _ = _batch(m, tok, lookup=False)
    got, got_lp, most, eng = _batch(m, tok, lookup=True)
    assert got == ref and all(len(t) == 30 for t in got)
    assert all(mx.array_equal(x, y).item() for a, b in zip(got_lp, ref_lp) for x, y in zip(a, b))
    st = eng.stats()
    assert st["lanes"] == {"batch": 5, "solo": 0} and st["solo_reasons"] == {}
    # the lookup rows (0, 2, 3) handed out several tokens in one step; the others one a step
    assert ref_most == [1] * 5 and most[1] == most[4] == 1
    assert max(most[i] for i in (0, 2, 3)) > 1
    spec = st["speculation"]
    assert spec["lookup"]["accepted"] > 0 and spec["drafted"] > spec["accepted"]   # some rejected
    recent = spec["recent"]
    assert [r["source"] for r in recent] == ["lookup"] * 3
    assert min(r["forwards"] for r in recent) < 30       # 30 tokens in fewer verify steps
    assert sum(r["accepted"] for r in recent) == spec["lookup"]["accepted"]
    assert sum(r["drafted"] for r in recent) == spec["lookup"]["drafted"]


def test_negative_control_rejected_drafts_left_in_the_batch_kv_differ(model, monkeypatch):
    """The rewind made a no-op: the rejected drafts and the padding stay in the rows' KV (and
    shift their positions), and the tokens change (the lookup rows' and their neighbours')."""
    m, tok = model
    ref, _, _, _ = _batch(m, tok, lookup=False)
    monkeypatch.setattr(BatchKVCache, "rewind", lambda self, drop: None)
    got, _, _, eng = _batch(m, tok, lookup=True)
    assert eng.stats()["speculation"]["drafted"] > eng.stats()["speculation"]["accepted"]
    assert got != ref


def _greedy_lookup(m, tok, prompt, params, stop_ids=(), cache_bytes=0, filler=True, tier="l1"):
    """One lookup request in a batch beside a plain greedy row; its tokens, its finish reason
    and the tokens of its last step that it did not hand out (`retire`'s `unused`). tier l3:
    the batch on the fast runner (its verify one fast step, engine.fast.slots)."""
    eng = Engine(m, tok, max_batch=4, keep_logprob_arrays=True,
                 levers=parse_spec("l3") if tier == "l3" else None,
                 prompt_cache=engine.PromptCache(cache_bytes) if cache_bytes else None)
    eng.eos = eng.eos | set(stop_ids)
    toks, reason, dropped, eng.runs = run_row(eng, prompt, params, None if filler else False)
    return toks, reason, dropped, eng


@pytest.mark.parametrize("tier", ["l1", "l3"])
def test_a_stop_inside_an_accepted_run_ends_the_row_there(model, tier):
    """max_tokens, a stop string and EOS landing inside a step's run of accepted drafts: the
    row hands out nothing after it (the rest of that step's tokens are dropped) and ends as
    the same row without lookup does."""
    m, tok = model
    run = functools.partial(_greedy_lookup, tier=tier)
    look = dict(temperature=0.0, prompt_lookup=1, num_draft_tokens=6)
    full, _, _, eng = run(m, tok, REPEATS, SamplingParams(max_tokens=30, **look))
    # the first step that handed out 2+ tokens: a stop string that completes at its first
    start = next(sum(eng.runs[:i]) for i, n in enumerate(eng.runs) if n >= 2)
    stop = tok.decode(full[:start + 1])
    eos = max(set(full), key=full.index)          # the token that first shows up last
    cases = [(dict(max_tokens=11), ()), (dict(max_tokens=30, stop=[stop]), ()),
             (dict(max_tokens=30), (eos,))]
    for kw, stop_ids in cases:
        want, why, _, _ = run(m, tok, REPEATS, SamplingParams(temperature=0.0, **kw),
                                         stop_ids=stop_ids)
        got, reason, dropped, _ = run(m, tok, REPEATS, SamplingParams(**kw, **look),
                                                 stop_ids=stop_ids)
        assert (got, reason) == (want, why) and got == full[:len(got)]
        assert reason == ("length" if kw["max_tokens"] == 11 else "stop")
        if "stop" in kw:      # the tokens verified after it in that step were not handed out
            assert dropped > 0


@pytest.mark.parametrize("tier", ["l1", "l3"])
def test_a_stop_mid_run_leaves_a_prompt_cache_that_answers_right(model, tier):
    """The row ends on a stop string inside an accepted run: the KV it leaves in the prompt
    cache holds exactly its tokens (the step's later ones trimmed), so a follow-up that hits
    it answers as a cold engine does."""
    m, tok = model
    run = functools.partial(_greedy_lookup, tier=tier)
    base = dict(temperature=0.0, prompt_lookup=1, num_draft_tokens=8)
    full, _, _, eng = run(m, tok, REPEATS, SamplingParams(max_tokens=30, **base))
    start = next(sum(eng.runs[:i]) for i, n in enumerate(eng.runs) if n >= 2)
    stop = tok.decode(full[:start + 1])           # completes at the first token of a run
    first, _, dropped, eng = run(
        m, tok, REPEATS, SamplingParams(max_tokens=30, stop=[stop], **base), cache_bytes=10**8)
    assert dropped > 0
    follow = REPEATS + first + [5, 6, 7]
    eng.submit(follow, SamplingParams(max_tokens=12, temperature=0.0))
    warm, cached = [], 0
    while eng.has_unfinished():
        for o in eng.step():
            warm += o.token_ids
            cached = max(cached, o.cached_tokens)
    cold, _, _, _ = run(m, tok, follow, SamplingParams(max_tokens=12, temperature=0.0),
                                   filler=False)
    assert cached > len(REPEATS) and warm == cold


def test_the_scheduler_alone_stops_rows_and_trims_their_kv(model):
    """BatchScheduler without the Engine (its own max_tokens and stop tokens): a lookup row
    ends at the same token as a plain row, and the KV it hands back holds its prompt and every
    token it handed out (offset = prompt + tokens), not the drafts verified after its stop."""
    m, tok = model
    plain = BatchScheduler(m, eos_token_ids=())
    uid = plain.submit(BatchRequest(REPEATS, max_tokens=30))
    full = [ev.token for ev in plain.run() if ev.uid == uid]
    stop_tok = full[13]
    for lookup in (None, RowLookup(1, 6)):
        sched = BatchScheduler(m, eos_token_ids=[stop_tok])
        a = sched.submit(BatchRequest(REPEATS, max_tokens=30, return_cache=True, lookup=lookup))
        b = sched.submit(BatchRequest(list(range(20, 50)), max_tokens=9, return_cache=True,
                                      lookup=lookup))
        evs = list(sched.run())
        toks = {u: [e.token for e in evs if e.uid == u] for u in (a, b)}
        last = {u: [e for e in evs if e.uid == u][-1] for u in (a, b)}
        k = full.index(stop_tok)
        assert toks[a] == full[:k + 1] and last[a].finish_reason == "stop"
        assert len(toks[b]) == 9 and last[b].finish_reason == "length"
        for u, p in ((a, REPEATS), (b, list(range(20, 50)))):
            assert last[u].caches[0].offset == len(p) + len(toks[u])
    # a lookup row with a sampler of its own is taken since 0.5.3 (refused before: "greedy")
    s2 = BatchScheduler(m)
    u = s2.submit(BatchRequest(REPEATS, max_tokens=5, lookup=RowLookup(1),
                               sampler=lambda lp, key=None: lp.argmax(-1)))
    assert len([e for e in s2.run() if e.uid == u]) == 5


def test_lookup_runs_alone_where_the_batch_cannot_take_it(model):
    """Deterministic mode keeps a lookup request on the exact runner (today's path); the fast
    runner (L3) takes it as a row since 0.6.0 (tests/engine/test_fast_verify.py)."""
    m, tok = model
    assert Engine(m, tok, max_batch=4, levers=parse_spec("l3")).lookup_rows
    for kw in ({"deterministic": True},):
        eng = Engine(m, tok, max_batch=4, **kw)
        assert not eng.lookup_rows
        eng.submit(REPEATS, SamplingParams(max_tokens=4, temperature=0.0, prompt_lookup=2))
        while eng.has_unfinished():
            eng.step()
        assert eng.stats()["solo_reasons"] == {"prompt_lookup": 1}
    assert Engine(m, tok, max_batch=4).lookup_rows


def test_seeded_sampled_lookup_rows_keep_their_tokens(model):
    """Sampled requests with prompt lookup are batch rows too (0.5.3): a draft is kept when the
    row's own draw at its position equals it, each later position drawn with the row's key
    only once the draft before was kept, so a seeded row's tokens and logprob vectors equal
    the same batch without lookup; drafts are kept (low temperature on repetitive prompts)."""
    m, tok = model

    def run(lookup):
        eng = Engine(m, tok, max_batch=len(PROMPTS), keep_logprob_arrays=True)
        rids = [eng.submit(p, SamplingParams(
            max_tokens=30, temperature=(0.2, 0.6, 1.0, 0.0, 0.3)[i], seed=11 + i,
            prompt_lookup=(1 if lookup else 0) if i != 3 else 0, num_draft_tokens=4))
            for i, p in enumerate(PROMPTS)]
        return drive(eng, rids), eng.stats()
    ref, _ = run(False)
    got, st = run(True)
    for (t, lp), (rt, rlp) in zip(got, ref):
        assert t == rt and len(t) == 30
        assert all(mx.array_equal(x, y).item() for x, y in zip(lp, rlp))
    assert st["lanes"] == {"batch": 5, "solo": 0}
    assert st["speculation"]["lookup"]["accepted"] > 0
