"""Draft-model speculation with `spec_sampling="rejection"` (engine.step.rejection) keeps the
target's sampling distribution, checked statistically on the tiny llama fixtures (bf16 target,
4-bit draft: at temperature 0.3, top-k 6 their distributions differ by a total variation of
about 0.3 at the first position).

Over a fixed set of seeds, the first two tokens of `draft_generate_step` (K = 2: the first
comes from an accepted draft or a residual draw, the second from the same round or the next)
are counted and compared with the target's exact sampling probabilities (one forward per
first token: p(t1) p(t2 | t1)) by a chi-square test at the 0.001 level. Two negative controls
fail the same test: every draft accepted, and the residual drawn from p instead of
max(0, p - q). The rule also keeps more drafts than the exact (mlx-lm) scheme on the same
seeds, and greedy requests are the same under both."""

import math
from collections import Counter

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.step.draft import draft_generate_step
from engine.step.rejection import RejectionRule, rejection_rule, sampling_probs
from engine.step.sampling import make_sampler
from engine.step.speculation import SpecStats
from parity.fixtures.models import ensure_fixture

PROMPT = "def fibonacci(n):"
SETTINGS = dict(temp=0.3, top_k=6)
SEEDS = range(1200)
K = 2
Z_001 = 3.0902                   # the standard normal's 0.999 quantile


@pytest.fixture(scope="module")
def fx():
    m, tok = engine.load(str(ensure_fixture("llama", "bfloat16")))
    d, _ = engine.load(str(ensure_fixture("llama", "q4")))
    return m, d, tok.encode(PROMPT), tok


def _probs(model, ids) -> mx.array:
    """The target's exact sampling distribution after `ids` [V]."""
    logits = model(mx.array(ids)[None])[0, -1:]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampling_probs(logprobs, make_sampler(**SETTINGS).settings)[0]


def _runs(m, d, ids, spec_sampling="rejection", seeds=SEEDS, n=2):
    """The first n tokens of each seeded run, and the summed counters. The prompt but its
    last token is prefilled once; each run starts from it (its caches trimmed back after)."""
    caches, draft_caches = m.make_cache(), d.make_cache()
    for mdl, c in ((m, caches), (d, draft_caches)):
        mdl(mx.array(ids[:-1])[None], cache=c)
        mx.eval([x.state for x in c])
    base = caches[0].offset
    sampler, stats, out = make_sampler(**SETTINGS), SpecStats(), []
    for seed in seeds:
        mx.random.seed(seed)
        out.append(tuple(t for t, _, _ in draft_generate_step(
            mx.array(ids[-1:]), m, d, max_tokens=n, caches=caches, draft_caches=draft_caches,
            num_draft_tokens=K, sampler=sampler, stats=stats, spec_sampling=spec_sampling)))
        for c in caches + draft_caches:
            c.trim(c.offset - base)
    return out, stats


def _chi_square(counts: Counter, expected: dict, n: int) -> tuple:
    """(statistic, critical value at 0.001): cells expecting >= 5 draws, the rest pooled
    (Wilson-Hilferty approximation of the chi-square quantile)."""
    big = [c for c, pr in expected.items() if pr * n >= 5]
    stat, rest_obs, rest_exp = 0.0, n, n
    for c in big:
        e = expected[c] * n
        stat += (counts[c] - e) ** 2 / e
        rest_obs -= counts[c]
        rest_exp -= e
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        big.append(None)
    df = len(big) - 1
    crit = df * (1 - 2 / (9 * df) + Z_001 * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


@pytest.fixture(scope="module")
def exact_joint(fx):
    """p(t1, t2) of the target's own sampling, for every t1 it can draw."""
    m, _, ids, _ = fx
    p1 = _probs(m, ids)
    joint = {}
    for t1 in [i for i, v in enumerate(p1.tolist()) if v > 0]:
        p2 = _probs(m, ids + [t1]).tolist()
        for t2, v in enumerate(p2):
            if v > 0:
                joint[(t1, t2)] = p1[t1].item() * v
    return joint


def _tests(pairs, joint) -> dict:
    n = len(pairs)
    first = Counter(t1 for t1, _ in pairs)
    marg = Counter()
    for (t1, _), v in joint.items():
        marg[t1] += v
    return {"first": _chi_square(first, dict(marg), n),
            "joint": _chi_square(Counter(pairs), joint, n)}


def test_the_first_tokens_have_the_target_distribution(fx, exact_joint):
    m, d, ids, _ = fx
    pairs, stats = _runs(m, d, ids)
    assert all(len(p) == 2 for p in pairs)
    for name, (stat, crit) in _tests(pairs, exact_joint).items():
        assert stat < crit, (name, stat, crit)
    assert stats.accepted > 0


@pytest.mark.parametrize("control", ["accept_every_draft", "residual_from_p"])
def test_negative_controls_fail_the_same_test(fx, exact_joint, monkeypatch, control):
    m, d, ids, _ = fx
    if control == "accept_every_draft":
        monkeypatch.setattr(RejectionRule, "accepts",
                            staticmethod(lambda px, qx, key=None: mx.ones(px.shape, dtype=mx.bool_)))
    else:
        monkeypatch.setattr(RejectionRule, "residual", staticmethod(lambda p, q: p))
    pairs, _ = _runs(m, d, ids)
    results = _tests(pairs, exact_joint)
    assert any(stat > crit for stat, crit in results.values()), results


def test_more_drafts_kept_than_the_exact_scheme(fx):
    m, d, ids, _ = fx
    rates = []
    for mode in ("exact", "rejection"):
        _, stats = _runs(m, d, ids, mode, range(100), n=8)
        rates.append(stats.accepted / stats.drafted)
    exact, rejection = rates
    assert rejection > exact + 0.2, rates


def test_greedy_is_the_same_under_both(fx):
    m, d, ids, _ = fx
    runs = []
    for mode in ("exact", "rejection"):
        runs.append(list(draft_generate_step(
            mx.array(ids), m, d, max_tokens=20, caches=m.make_cache(),
            draft_caches=d.make_cache(), num_draft_tokens=3, spec_sampling=mode)))
    (a, b) = runs
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    assert all(mx.array_equal(x, y).item() for (_, x, _), (_, y, _) in zip(a, b))
    assert rejection_rule(make_sampler(temp=0.0), "rejection") is None


def test_the_engine_runs_it_and_counts_it(fx):
    """An Engine request with spec_sampling="rejection": seeded runs repeat, its counters
    reach /stats' speculation.draft; bad settings are refused."""
    m, d, ids, tok = fx
    outs = []
    for _ in range(2):
        eng = Engine(m, tok, max_batch=1, draft_model=d)
        eng.submit(ids, SamplingParams(max_tokens=16, temperature=0.3, top_k=6, seed=3,
                                       num_draft_tokens=3, spec_sampling="rejection"))
        toks = []
        while eng.has_unfinished():
            for o in eng.step():
                assert o.error is None
                toks += o.token_ids
        outs.append(toks)
        spec = eng.stats()["speculation"]["draft"]
        assert 0 < spec["accepted"] <= spec["drafted"]
    assert outs[0] == outs[1] and len(outs[0]) >= 1
    for bad in (dict(spec_sampling="sometimes"),
                dict(spec_sampling="rejection", xtc_probability=0.5)):
        with pytest.raises(ValueError, match="spec_sampling"):
            SamplingParams(temperature=0.5, **bad)
    with pytest.raises(ValueError, match="spec_sampling"):
        rejection_rule(make_sampler(temp=0.5), "sometimes")


def test_the_clis_take_spec_sampling(capsys):
    from engine.cli import main
    from server.cli import main as serve
    path, draft = (str(ensure_fixture("llama", d)) for d in ("bfloat16", "q4"))
    base = ["--model", path, "-p", "hi", "-m", "6", "--temp", "0.5", "--seed", "2",
            "--verbose", "False"]
    assert main([*base, "--spec-sampling", "rejection"]) == 2
    assert "--spec-sampling rejection needs --draft-model" in capsys.readouterr().err
    outs = []
    for _ in range(2):
        assert main([*base, "--draft-model", draft, "--spec-sampling", "rejection"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()
    assert main([*base, "--draft-model", draft, "--spec-sampling", "rejection",
                 "--xtc-probability", "0.5"]) == 2
    assert "spec_sampling 'rejection' does not take" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--spec-sampling rejection needs --draft-model"):
        serve(["--model", path, "--spec-sampling", "rejection"])


def test_served_requests_choose_spec_sampling():
    """engine-serve --draft-model: the request field `spec_sampling` (else the server's
    --spec-sampling) reaches the engine: a seeded rejection-sampled completion repeats, keeps
    drafts (/stats), and differs from the exact scheme's; a bad value is a 400."""
    import httpx

    from tests.server.srv_helpers import start_server, stop_server
    path, draft = (str(ensure_fixture("llama", d)) for d in ("bfloat16", "q4"))
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.3, "top_k": 6, "seed": 5}
    s = start_server(path, draft_model=draft, num_draft_tokens=3, prompt_cache_bytes=0,
                     spec_sampling="rejection")
    try:
        texts = []
        for extra in ({}, {}, {"spec_sampling": "exact"}):
            r = httpx.post(s.url + "/v1/completions", json={**body, **extra}, timeout=60)
            assert r.status_code == 200
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1] and texts[0] != texts[2]
        assert httpx.get(s.url + "/stats").json()["speculation"]["draft"]["accepted"] > 0
        r = httpx.post(s.url + "/v1/completions", json={**body, "spec_sampling": "sometimes"},
                       timeout=60)
        assert r.status_code == 400 and "spec_sampling" in r.text
    finally:
        stop_server(s)


def _batch_pairs(m, d, ids, seeds=SEEDS):
    """The first two tokens of one seeded batch row per seed (32 rows at a time, each with its
    own key; K drafts a step by the rule), and the rows' summed counters. A row's first token
    is the batch's plain sample; its second the first verify round's (a kept draft, or the
    residual draw)."""
    from engine.step.batch import BatchRequest, BatchScheduler
    from engine.step.batch_draft import RowDraft
    sched = BatchScheduler(m, eos_token_ids=(), draft_model=d, completion_batch_size=32)
    sampler, stats = make_sampler(**SETTINGS), SpecStats()
    uids = [sched.submit(BatchRequest(ids, max_tokens=2, sampler=sampler, seed=s,
                                      draft=RowDraft(K, stats=stats, rejection=True)))
            for s in seeds]
    toks = {u: [] for u in uids}
    while sched.has_work():
        for ev in sched.step():
            toks[ev.uid].append(ev.token)
    return [tuple(toks[u]) for u in uids], stats


@pytest.mark.parametrize("control", [None, "accept_every_draft", "residual_from_p"])
def test_batch_rows_keep_the_target_distribution(fx, exact_joint, monkeypatch, control):
    """Rejection-sampled draft rows of the continuous batch (engine.step.batch_draft, each row
    drawing from its own key) give the target's joint distribution of their first two tokens
    (the second from the rule), by the same chi-square test; both negative controls fail it."""
    m, d, ids, _ = fx
    if control == "accept_every_draft":
        monkeypatch.setattr(RejectionRule, "accepts",
                            staticmethod(lambda px, qx, key=None: mx.ones(px.shape, dtype=mx.bool_)))
    elif control == "residual_from_p":
        monkeypatch.setattr(RejectionRule, "residual", staticmethod(lambda p, q: p))
    pairs, stats = _batch_pairs(m, d, ids)
    assert all(len(p) == 2 for p in pairs) and stats.accepted > 0
    results = _tests(pairs, exact_joint)
    if control is None:
        assert all(stat < crit for stat, crit in results.values()), results
        again, _ = _batch_pairs(m, d, ids, seeds=range(40))      # seeded: the same tokens
        assert again == pairs[:40]
    else:
        assert any(stat > crit for stat, crit in results.values()), results


def test_a_draft_with_fewer_embedding_rows_verifies_in_the_batch(fx, tmp_path):
    """check_draft takes a draft with fewer embedding rows than the target (same tokenizer):
    its q [1, V_draft] is 0 past them. As a rejection-sampled batch row it failed with
    MLX's broadcast error (p - q), answered as a 400; the rule pads q."""
    import json
    import shutil
    m, _, ids, tok = fx
    src = ensure_fixture("llama", "float32")
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    cfg = json.loads((cut / "config.json").read_text())
    rows = cfg["vocab_size"] - 24
    cfg["vocab_size"] = rows
    (cut / "config.json").write_text(json.dumps(cfg))
    w = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(cut / "model.safetensors"),
                        {k: v[:rows] if ("embed" in k or "lm_head" in k) else v for k, v in w.items()})
    d, _ = engine.load(str(cut))
    eng = Engine(m, tok, max_batch=4, draft_model=d)
    for seed in (1, 2):
        eng.submit(ids, SamplingParams(max_tokens=12, temperature=0.5, seed=seed,
                                       num_draft_tokens=3, spec_sampling="rejection"))
    done = 0
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            done += o.finish_reason is not None
    assert done == 2 and eng.stats()["speculation"]["draft"]["drafted"] > 0
    q = mx.softmax(mx.random.normal((1, rows)), axis=-1)
    lp = mx.random.normal((2, rows + 24))
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    tokens, ok = RejectionRule(make_sampler(temp=0.5).settings).verify(lp, mx.array([3]), [q])
    assert len(tokens) == ok + 1
