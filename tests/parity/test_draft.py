"""L1: draft-model speculative decoding vs mlx-lm's `speculative_generate_step`, the live
oracle: the same tokens, logprob vectors (`mx.array_equal`) and draft flags, greedy and
seeded sampling, for the families mlx-lm speculates on (llama, qwen3: a float target, a
draft of the same family and tokenizer), and the global PRNG left in the same state
(the same draws, in the same order). Through `engine.step.draft.draft_generate_step`, through
the `Engine` (one row; a batching engine, where the request is a speculating batch row,
engine.step.batch_draft: greedy, mlx-lm's speculative tokens; seeded sampled, its seeded
loop's without speculation), and through
`engine-generate --draft-model` against `mlx_lm generate --draft-model`. A negative control
(rejected drafts left in the caches) makes the comparison fail."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import speculative_generate_step as ref_speculative
from mlx_lm.sample_utils import make_sampler as ref_sampler

import engine
from engine import Engine, SamplingParams
from engine.step.draft import draft_generate_step
from engine.step.sampling import make_sampler
from engine.step.speculation import SpecStats
from parity.fixtures.models import ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity

# (target, draft) fixtures: (dtype, variant). qwen3's greedy answer repeats one token, which
# its quantized copies always draft right; the long variant (its EOS rows scaled) rejects some
PAIRS = {"llama": (("bfloat16", ""), ("q4", "")), "qwen3": (("float32", ""), ("bfloat16", "long"))}
PROMPT = "def fibonacci(n):\n    return n if n < 2 else fib"
MAX = 40
# greedy, then sampled: low temperatures so the tiny random models' draws match the draft's
# now and then (at temperature 1 almost nothing is accepted: a draft kept needs the target's
# own draw to equal it), and every filter of the sampler over the verify step's K + 1 rows
SETTINGS = [dict(temperature=0.0), dict(temperature=0.1), dict(temperature=0.3, top_p=0.9),
            dict(temperature=0.2, top_k=5), dict(temperature=0.15, min_p=0.1),
            dict(temperature=1.0)]
SETTING_IDS = ["-".join(f"{k}{v}" for k, v in s.items()) for s in SETTINGS]


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request):
    family = request.param
    target, draft = (str(ensure_fixture(family, d, variant=v)) for d, v in PAIRS[family])
    (m, tok), (d, _) = engine.load(target), engine.load(draft)
    (rm, rtok), rd = oracle.load(target), oracle.load_model(draft)
    ids = tok.encode(PROMPT)
    assert ids == rtok.encode(PROMPT)
    return family, m, d, tok, rm, rd, ids


def _sampler_kw(s: dict) -> dict:
    return dict(temp=s["temperature"], top_p=s.get("top_p", 0.0), min_p=s.get("min_p", 0.0),
                top_k=s.get("top_k", 0))


def _oracle(rm, rd, ids, k, s, seed, max_tokens=MAX):
    """mlx-lm's (token, logprobs, from_draft) triples, and the PRNG state after them."""
    mx.random.seed(seed)
    out = [(int(t), lp, bool(f)) for t, lp, f in ref_speculative(
        mx.array(ids), rm, rd, num_draft_tokens=k, max_tokens=max_tokens,
        sampler=ref_sampler(**_sampler_kw(s)), prefill_step_size=2048)]
    return out, mx.array(mx.random.state[0])


def _ours(m, d, ids, k, s, seed, stats=None, max_tokens=MAX):
    mx.random.seed(seed)
    out = list(draft_generate_step(
        mx.array(ids), m, d, max_tokens=max_tokens, caches=m.make_cache(),
        draft_caches=d.make_cache(), num_draft_tokens=k, sampler=make_sampler(**_sampler_kw(s)),
        stats=stats))
    return out, mx.array(mx.random.state[0])


def _same(ours, ref) -> bool:
    return (len(ours) == len(ref) and [t for t, _, _ in ours] == [t for t, _, _ in ref]
            and [f for _, _, f in ours] == [f for _, _, f in ref]
            and all(mx.array_equal(a, b).item() for (_, a, _), (_, b, _) in zip(ours, ref)))


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_draft_generate_step_equals_mlx_lm(pair, settings, k):
    family, m, d, _, rm, rd, ids = pair
    kept = 0
    for seed in (0, 7):
        ref, ref_state = _oracle(rm, rd, ids, k, settings, seed)
        stats = SpecStats()
        ours, state = _ours(m, d, ids, k, settings, seed, stats)
        assert _same(ours, ref), (family, settings, k, seed)
        assert mx.array_equal(state, ref_state).item()     # the same draws, in the same order
        assert len(ours) == MAX
        assert stats.accepted == sum(f for _, _, f in ours)
        if settings["temperature"] == 0.0:
            # both branches ran: drafts rejected, and whole rounds of k accepted (the draft's
            # next forward then takes its last draft and the target's token together)
            flags = "".join("d" if f else "t" for _, _, f in ours)
            assert 0 < stats.accepted < stats.drafted and "d" * k + "t" in flags
        kept += stats.accepted
    if 0 < settings["temperature"] <= 0.2:    # sampled drafts kept too (the draws agreed)
        assert kept > 0


def test_max_tokens_inside_an_accepted_run_and_below_k(pair):
    """max_tokens smaller than K, and ending inside a run of accepted drafts."""
    _, m, d, _, rm, rd, ids = pair
    for n in (1, 2, 5, 7):
        ref, _ = _oracle(rm, rd, ids, 4, SETTINGS[0], 0, max_tokens=n)
        ours, _ = _ours(m, d, ids, 4, SETTINGS[0], 0, max_tokens=n)
        assert _same(ours, ref) and len(ours) == n


def _engine_run(m, d, tok, ids, k, s, seed, max_batch):
    eng = Engine(m, tok, max_batch=max_batch, keep_logprob_arrays=True, draft_model=d)
    rid = eng.submit(ids, SamplingParams(max_tokens=MAX, seed=seed, num_draft_tokens=k,
                                         **{"top_p": 0.0, "top_k": 0, "min_p": 0.0, **s}))
    toks, lps, last = [], [], None
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == rid and o.error is None
            toks += o.token_ids
            lps += o.logprob_arrays
            last = o
    return toks, lps, last, eng


@pytest.mark.parametrize("max_batch", [1, 4])
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[1], SETTINGS[3]],
                         ids=[SETTING_IDS[0], SETTING_IDS[1], SETTING_IDS[3]])
def test_the_engine_equals_mlx_lm(pair, settings, max_batch):
    """An `Engine` with a draft model, alone on the exact runner (max_batch 1): the tokens and
    logprob vectors mlx-lm's speculative loop gives, up to EOS, and its counts. On a batching
    engine the request is a batch row that drafts (engine.step.batch_draft): greedy, the same
    tokens as mlx-lm's speculative loop; seeded sampled, its own key (docs/batching.md,
    per-row seeds) drawn only for the positions it hands out, so the tokens of mlx-lm's seeded
    loop *without* speculation (`generate_step`: speculation does not change a seeded row's
    answer), drafts kept too. A row's first token comes from the batch's plain first step, so
    its verify rounds are its own (its counts are not mlx-lm's)."""
    from mlx_lm.generate import generate_step as ref_generate
    _, m, d, tok, rm, rd, ids = pair
    sampled_row = max_batch > 1 and settings["temperature"] > 0
    for seed in (0, 7):
        if sampled_row:
            mx.random.seed(seed)
            ref = [(int(t), lp, False) for t, lp in ref_generate(
                mx.array(ids), rm, max_tokens=MAX, sampler=ref_sampler(**_sampler_kw(settings)),
                prefill_step_size=2048)]
        else:
            ref, _ = _oracle(rm, rd, ids, 3, settings, seed)
        toks, lps, last, eng = _engine_run(m, d, tok, ids, 3, settings, seed, max_batch)
        handed = len(toks) + (last.finish_reason == "stop")     # (EOS is handed out too)
        assert toks == [t for t, _, _ in ref][:len(toks)] and handed >= 1
        assert all(mx.array_equal(a, b).item() for a, (_, b, _) in zip(lps, ref))
        spec = eng.stats()["speculation"]
        if max_batch == 1:
            assert spec["draft"]["accepted"] == sum(f for _, _, f in ref[:handed])
        assert 0 < spec["draft"]["accepted"] < handed
        assert last.speculation == {k: spec["draft"][k] for k in last.speculation}
        assert spec["lookup"]["drafted"] == 0 and spec["recent"][-1]["source"] == "draft"
        if max_batch > 1:
            assert eng.stats()["solo_reasons"] == {}


def test_negative_control_rejected_drafts_left_in_the_caches(pair, monkeypatch):
    _, m, d, _, rm, rd, ids = pair
    ref, _ = _oracle(rm, rd, ids, 3, SETTINGS[0], 0)
    from engine.kv.cache import KVCache
    monkeypatch.setattr(KVCache, "trim", lambda self, n: 0)
    ours, _ = _ours(m, d, ids, 3, SETTINGS[0], 0)
    assert [t for t, _, _ in ours] != [t for t, _, _ in ref]


@pytest.mark.parametrize("extra", [[], ["--temp", "0.1", "--seed", "3"],
                                   ["--temp", "0.9", "--top-p", "0.9", "--seed", "5"],
                                   ["--num-draft-tokens", "5"]],
                         ids=["greedy", "seeded", "seeded-top-p", "k5"])
def test_engine_generate_prints_what_mlx_lm_generate_prints(extra):
    """`engine-generate --draft-model` and `mlx_lm generate --draft-model` (its default K, 3,
    ours too), byte for byte."""
    from tests.parity.test_cli_generate import both
    target, draft = (str(ensure_fixture("llama", d, variant=v)) for d, v in PAIRS["llama"])
    ref, ours = both(["--model", target, "--draft-model", draft, "-p", "hi", "-m", "30",
                      "--verbose", "False", *extra])
    assert ours == ref and ours.strip()
