"""engine.step.sampling vs live mlx-lm 0.32.2 sample_utils: exact equality only."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from mlx_lm import sample_utils as ref
from mlx_lm.generate import generate_step as ref_generate_step

from engine.step import sampling as ours
DTYPES = [mx.float32, mx.bfloat16, mx.float16]


def rand_logits(seed, shape, dtype=mx.float32, scale=3.0, ties=False):
    """Logits from numpy (so building them consumes no MLX PRNG state)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * scale
    if ties:  # coarse values: many exact ties, incl. at the top-k boundary
        x = np.round(x)
    return mx.array(x).astype(dtype)


def logprobs_of(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def same(a, b):
    mx.eval(a, b)
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


def rng_state():
    return np.array(mx.random.state[0])


# ------------------------------------------------------------------ filters

@pytest.mark.parity
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ties", [False, True])
def test_filters_match_oracle(dtype, ties):
    for seed, (B, V) in enumerate([(1, 64), (3, 257), (2, 1000)]):
        lp = logprobs_of(rand_logits(seed, (B, V), dtype, ties=ties))
        for p in [0.05, 0.5, 0.9, 0.999]:
            assert same(ours.apply_top_p(lp, p), ref.apply_top_p(lp, p)), (dtype, p)
        for mp, keep in [(0.01, 1), (0.2, 1), (0.5, 3), (1.0, 1), (0.9, 10)]:
            assert same(ours.apply_min_p(lp, mp, keep), ref.apply_min_p(lp, mp, keep)), (mp, keep)
        for k in [1, 2, 5, 17, V - 1]:
            assert same(ours.apply_top_k(lp, k), ref.apply_top_k(lp, k)), (dtype, k)


@pytest.mark.parity
@pytest.mark.parametrize("dtype", DTYPES)
def test_xtc_matches_oracle_and_consumes_same_rng(dtype):
    lp = logprobs_of(rand_logits(7, (2, 300), dtype, scale=1.0))
    for prob, thr, special in [(1.0, 0.001, []), (0.5, 0.01, [3, 5]), (0.3, 0.2, [0])]:
        mx.random.seed(11)
        a = [ours.apply_xtc(lp, prob, thr, special) for _ in range(6)]
        sa = rng_state()
        mx.random.seed(11)
        b = [ref.apply_xtc(lp, prob, thr, special) for _ in range(6)]
        sb = rng_state()
        assert all(same(x, y) for x, y in zip(a, b))
        assert (sa == sb).all()
    # the probability-1 mask really removes something (the check can fail)
    assert not same(ours.apply_xtc(lp, 1.0, 0.001, []), lp)


# ------------------------------------------------------------------ samplers

SETTINGS = [
    dict(temp=1.0),
    dict(temp=0.7),
    dict(temp=3),  # int temperature
    dict(temp=0.8, top_p=0.9),
    dict(temp=1.0, top_p=0.5, top_k=10),
    dict(temp=0.6, min_p=0.05),
    dict(temp=0.6, min_p=0.3, min_tokens_to_keep=4),
    dict(temp=1.3, top_k=1),
    dict(temp=1.0, top_k=40),
    dict(temp=0.9, top_p=0.95, min_p=0.02, top_k=50),
    dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.05),
    dict(temp=0.8, xtc_probability=1.0, xtc_threshold=0.01, xtc_special_tokens=[0, 1, 2]),
    dict(temp=1.1, top_p=0.8, min_p=0.01, top_k=20, xtc_probability=0.7, xtc_threshold=0.02),
    dict(temp=1.0, top_p=1.0),  # off in both
    dict(temp=0.5, top_p=0.0, min_p=0.0, top_k=0),
]


@pytest.mark.parity
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampler_sequences_match_oracle(settings, dtype):
    s_ours, s_ref = ours.make_sampler(**settings), ref.make_sampler(**settings)
    steps = [logprobs_of(rand_logits(100 + i, (B, 500), dtype, scale=2.0))
             for i, B in enumerate([1, 1, 3, 1, 2, 1, 4, 1])]
    mx.eval(steps)
    for seed in (0, 1234):
        mx.random.seed(seed)
        got = [s_ours(lp) for lp in steps]
        st_ours = rng_state()
        mx.random.seed(seed)
        want = [s_ref(lp) for lp in steps]
        st_ref = rng_state()
        for i, (g, w) in enumerate(zip(got, want)):
            assert same(g, w), (seed, i, g.tolist(), w.tolist())
        assert (st_ours == st_ref).all(), "PRNG key consumption differs"
    # sampling really is random here: different seeds give different draws
    mx.random.seed(0)
    a = [s_ours(lp).tolist() for lp in steps]
    mx.random.seed(1)
    b = [s_ours(lp).tolist() for lp in steps]
    if settings.get("top_k") != 1:
        assert a != b


@pytest.mark.parity
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_matches_oracle(dtype):
    for settings in [dict(), dict(temp=0.0, top_p=0.5, top_k=3, min_p=0.2)]:
        s_ours, s_ref = ours.make_sampler(**settings), ref.make_sampler(**settings)
        for seed in range(4):
            lp = logprobs_of(rand_logits(seed, (3, 333), dtype, ties=True))
            mx.random.seed(5)
            got = s_ours(lp)
            mx.random.seed(5)
            want = s_ref(lp)
            assert same(got, want)
            assert same(got, mx.argmax(lp, axis=-1))


def test_temperature_and_filters_take_effect():
    lp = logprobs_of(rand_logits(3, (1, 50), scale=1.0))
    top = set(np.argsort(-np.array(lp[0]))[:3].tolist())
    s = ours.make_sampler(temp=5.0, top_k=3)
    mx.random.seed(0)
    draws = {s(lp).item() for _ in range(200)}
    assert draws <= top and len(draws) == 3
    s_hot = ours.make_sampler(temp=5.0)
    mx.random.seed(0)
    assert len({s_hot(lp).item() for _ in range(200)}) > 10


def test_top_k_at_least_vocab_keeps_everything():
    lp = logprobs_of(rand_logits(0, (2, 16)))
    assert same(ours.apply_top_k(lp, 16), lp)
    assert same(ours.apply_top_k(lp, 100), lp)
    # mlx-lm raises instead (documented divergence)
    with pytest.raises(ValueError):
        ref.apply_top_k(lp, 16)
    mx.random.seed(2)
    a = ours.make_sampler(temp=1.0, top_k=100)(lp)
    mx.random.seed(2)
    b = ref.make_sampler(temp=1.0)(lp)
    assert same(a, b)


# ------------------------------------------------------------- per-call key

def test_keyed_sampling_uses_no_global_state_and_is_row_independent():
    lp = logprobs_of(rand_logits(9, (4, 200), scale=2.0))
    for settings in [dict(temp=1.0), dict(temp=0.9, top_p=0.9, top_k=30),
                     dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.02)]:
        s = ours.make_sampler(**settings)
        keys = mx.stack([mx.random.key(i) for i in range(4)])
        mx.random.seed(3)
        before = rng_state()
        batched = s(lp, key=keys)
        assert (rng_state() == before).all(), "a keyed call touched the global PRNG"
        rows = mx.concatenate([s(lp[e:e + 1], key=keys[e]) for e in range(4)])
        assert same(batched, rows)
        assert same(s(lp, key=keys), batched)  # deterministic
        one = s(lp, key=mx.random.key(0))
        assert one.shape == (4,)
        assert same(one, s(lp, key=mx.random.key(0)))
    # with no XTC, a key feeds mx.random.categorical directly
    k = mx.random.key(42)
    assert same(ours.make_sampler(temp=0.5)(lp, key=k),
                mx.random.categorical(lp * (1.0 / 0.5), key=k))
    # different row keys give different draws somewhere
    s = ours.make_sampler(temp=2.0)
    a = [s(lp, key=mx.stack([mx.random.key(i)] * 4)).tolist() for i in range(5)]
    assert len({tuple(x) for x in a}) > 1
    with pytest.raises(ValueError, match="one per row"):
        s(lp, key=mx.stack([mx.random.key(0)] * 3))


# ------------------------------------------------------------ processors

PROC_SETTINGS = [
    dict(logit_bias={0: 5.0, 7: -100.0, 42: 2.5}),
    dict(logit_bias={3: 1, 9: -2}),  # int biases
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7, repetition_context_size=5),
    dict(repetition_penalty=1.1, repetition_context_size=1),
    dict(presence_penalty=0.5),
    dict(presence_penalty=-1.5, presence_context_size=7),
    dict(frequency_penalty=0.3),
    dict(frequency_penalty=0.1, frequency_context_size=12),
    dict(logit_bias={1: 0.25}, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.6,
         repetition_context_size=10, presence_context_size=15, frequency_context_size=30),
]


def _fresh(x):
    # mlx-lm's repetition/presence processors assign into their input in place
    return mx.array(np.array(x.astype(mx.float32))).astype(x.dtype)


@pytest.mark.parity
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("settings", PROC_SETTINGS, ids=lambda s: ",".join(s))
def test_processors_match_oracle(settings, dtype):
    p_ours, p_ref = ours.make_logits_processors(**settings), ref.make_logits_processors(**settings)
    assert len(p_ours) == len(p_ref) > 0
    rng = np.random.default_rng(0)
    for trial, B in enumerate([1, 2, 1, 3]):
        logits = rand_logits(trial, (B, 128), dtype, ties=(trial % 2 == 1))
        # a history with many repeats, so repeated-id semantics matter
        hist = mx.array(rng.integers(0, 40, size=int(rng.integers(1, 60))).astype(np.int32))
        a, b = _fresh(logits), _fresh(logits)
        for po, pr in zip(p_ours, p_ref):
            a, b = po(hist, a), pr(hist, b)
            assert same(a, b), (settings, trial)
        assert not same(a, logits)  # the processors did something
    # empty history: everything but the bias is a no-op
    logits = rand_logits(9, (1, 128), dtype)
    a, b = _fresh(logits), _fresh(logits)
    for po, pr in zip(p_ours, p_ref):
        a, b = po(mx.array([], dtype=mx.int32), a), pr(mx.array([], dtype=mx.int32), b)
    assert same(a, b)


def test_processors_do_not_modify_their_input():
    logits = rand_logits(0, (1, 32))
    keep = np.array(logits)
    hist = mx.array([1, 2, 2, 3])
    for p in ours.make_logits_processors(repetition_penalty=1.5, presence_penalty=1.0,
                                         frequency_penalty=1.0, logit_bias={4: 1.0}):
        out = p(hist, logits)
        assert (np.array(logits) == keep).all()
        assert not (np.array(out) == keep).all()
    # the oracle does modify it (documented quirk)
    x = _fresh(logits)
    ref.make_repetition_penalty(1.5)(hist, x)
    assert not (np.array(x) == keep).all()


def test_processor_semantics():
    logits = mx.array([[2.0, -2.0, 1.0, 0.5]])
    hist = mx.array([0, 1, 1, 1])
    rep, = ours.make_logits_processors(repetition_penalty=2.0)
    assert rep(hist, logits).tolist() == [[1.0, -4.0, 1.0, 0.5]]
    pres, = ours.make_logits_processors(presence_penalty=1.0)
    assert pres(hist, logits).tolist() == [[1.0, -3.0, 1.0, 0.5]]
    freq, = ours.make_logits_processors(frequency_penalty=1.0)
    assert freq(hist, logits).tolist() == [[1.0, -5.0, 1.0, 0.5]]
    win, = ours.make_logits_processors(frequency_penalty=1.0, frequency_context_size=2)
    assert win(hist, logits).tolist() == [[2.0, -4.0, 1.0, 0.5]]
    whole, = ours.make_logits_processors(frequency_penalty=1.0, frequency_context_size=None)
    assert whole(hist, logits).tolist() == [[1.0, -5.0, 1.0, 0.5]]
    bias, = ours.make_logits_processors(logit_bias={"3": 10})  # JSON-style key
    assert bias([], logits).tolist() == [[2.0, -2.0, 1.0, 10.5]]
    assert rep([1], logits).tolist() == [[2.0, -4.0, 1.0, 0.5]]  # plain list history
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.make_logits_processors(logit_bias={4: 1.0})[0](hist, logits)
    assert ours.make_logits_processors() == []
    assert ours.make_logits_processors(repetition_penalty=0, presence_penalty=0,
                                       frequency_penalty=0, logit_bias={}) == []


# ---------------------------------------------------------- the token loop

class _TableModel:
    """logits = table[token]: a deterministic stand-in for a model."""

    def __init__(self, V=97, seed=0):
        self.table = rand_logits(seed, (V, V), scale=2.0)

    def __call__(self, x, cache=None):
        return self.table[x]

    def make_cache(self):
        return []


@pytest.mark.parity
@pytest.mark.parametrize("settings,procs", [
    (dict(temp=0.0), dict(repetition_penalty=1.5, logit_bias={5: 3.0})),
    (dict(temp=1.0, top_p=0.9), dict(presence_penalty=0.8, frequency_penalty=0.4)),
    (dict(temp=0.7, min_p=0.05, top_k=20), dict(repetition_penalty=1.2, repetition_context_size=4)),
    (dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.05), dict()),
])
def test_generation_loop_matches_oracle(settings, procs):
    from engine.step.stepper import generate_step

    model = _TableModel()
    prompt = mx.array([1, 2, 3, 2, 1], dtype=mx.int32)
    mx.random.seed(77)
    want = [t for t, _ in ref_generate_step(
        prompt, model, max_tokens=40, sampler=ref.make_sampler(**settings),
        logits_processors=ref.make_logits_processors(**procs) or None, prompt_cache=[])]
    mx.random.seed(77)
    got = [t for t, _ in generate_step(
        prompt, model, max_tokens=40, sampler=ours.make_sampler(**settings),
        logits_processors=ours.make_logits_processors(**procs) or None, caches=[])]
    assert got == want
    assert len(set(got)) > 1


# -------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs,match", [
    (dict(temp=-0.1), "temp"),
    (dict(temp=float("nan")), "temp"),
    (dict(temp="hot"), "temp"),
    (dict(temp=1.0, top_p=1.5), "top_p"),
    (dict(temp=1.0, top_p=-0.1), "top_p"),
    (dict(temp=1.0, min_p=2.0), "min_p"),
    (dict(temp=1.0, top_k=-1), "top_k"),
    (dict(temp=1.0, top_k=2.5), "top_k"),
    (dict(temp=1.0, top_k=True), "top_k"),
    (dict(temp=1.0, min_tokens_to_keep=0), "min_tokens_to_keep"),
    (dict(temp=1.0, xtc_probability=1.2), "xtc_probability"),
    (dict(temp=1.0, xtc_threshold=0.6), "xtc_threshold"),
    (dict(temp=1.0, xtc_special_tokens=[-1]), "xtc_special_tokens"),
    (dict(temp=0.0, top_p=7), "top_p"),  # validated even when greedy
])
def test_sampler_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ours.make_sampler(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty="x"), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=1.1, repetition_context_size=0), "repetition_context_size"),
    (dict(presence_penalty=1.0, presence_context_size=-3), "presence_context_size"),
    (dict(frequency_penalty=1.0, frequency_context_size=2.5), "frequency_context_size"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(logit_bias=[(1, 1.0)]), "logit_bias"),
])
def test_processor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ours.make_logits_processors(**kwargs)


def test_engine_does_not_import_mlx_lm():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(ours))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "mlx.core" in names
    assert not [n for n in names if n.split(".")[0] in ("mlx_lm", "optiq", "transformers")]
