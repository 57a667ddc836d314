"""L1 with levers on: still bit-exact with mlx-lm (the levers' tier is proved, not assumed).

- merged q/k/v and gate/up projections (`--merged-proj`): every family and weight
  format, per-step log-probs of the token loop equal mlx-lm's `generate_step`.
- the L3 fast decode step on the CPU (stock-MLX reference ops, compiled, over a
  preallocated cache): equal to mlx-lm for the families it covers. On the CPU it is
  therefore exact; on a GPU its kernels change rounding and the KL gate applies
  (parity/l3_gate.py).
- models the fast step does not cover fall back to the L1 path and stay exact.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as ref_generate_step

import engine
from engine.fast.apply import decoder_for, describe
from engine.fast.decode import why_not
from engine.fast.merge import Part, merge_projections
from engine.levers import resolve
from engine.loader import load_model
from engine.step.stepper import generate_step
from parity.fixtures.models import DTYPES, FAMILIES, cpu_dtypes, ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity

PROMPT = list(range(40, 80)) + [7, 300, 512, 9]


def _ref_steps(path, n):
    return list(ref_generate_step(mx.array(PROMPT), oracle.load_model(str(path)), max_tokens=n))


def _assert_same(mine, ref):
    assert [t for t, _ in mine] == [int(t) for t, _ in ref]
    for (_, a), (_, b) in zip(mine, ref):
        assert mx.array_equal(a, b).item()


# (MoE families: no bf16 fixture on the CPU, whose gather_mm is float32-only for mlx-lm too)
@pytest.mark.parametrize("family, dtype", [(f, d) for d in DTYPES for f in FAMILIES
                                           if d in cpu_dtypes(f)])
def test_merged_projections_equal_mlx_lm(family, dtype):
    path = ensure_fixture(family, dtype)
    model = load_model(path)[0]
    assert merge_projections(model) > 0
    assert isinstance(model.layers[0].self_attn.q_proj, Part)
    _assert_same(list(generate_step(mx.array(PROMPT), model, max_tokens=12)), _ref_steps(path, 12))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_fast_decode_equals_mlx_lm(family, dtype):
    path = ensure_fixture(family, dtype)
    model = load_model(path)[0]
    lv = resolve("l3", env={})
    dec = decoder_for(model, lv, model.make_cache())
    assert dec is not None
    mine = list(generate_step(mx.array(PROMPT), model, max_tokens=16, decoder=dec))
    _assert_same(mine, _ref_steps(path, 16))
    assert dec.stats.steps >= 16 and dec.stats.traces == 1   # (the loop runs one step ahead)
    assert describe(lv, model)["fast_decode"] is True
    # every projection of a float model went through engine.fast.gemv's path (its stock-MLX
    # side on the CPU); quantized ones take MLX's quantized matmul (the test below)
    assert dec.stats.gemv == (dtype not in ("q4", "q8"))


@pytest.mark.parametrize("dtype", ["q4", "q8"])
def test_cpu_fast_decode_quantized_without_the_gemv_equals_mlx_lm(dtype):
    """Quantized models take the step of add+RMSNorm and RoPE kernels around MLX's quantized
    matmul: also exact on the CPU."""
    path = ensure_fixture("llama", dtype)
    model = load_model(path)[0]
    dec = decoder_for(model, resolve("l3", env={}), model.make_cache())
    mine = list(generate_step(mx.array(PROMPT), model, max_tokens=16, decoder=dec))
    _assert_same(mine, _ref_steps(path, 16))
    assert not dec.stats.gemv


def test_stream_generate_with_l3_levers_matches_mlx_lm_text():
    path = str(ensure_fixture("llama", "bfloat16"))
    model, tok = engine.load(path)
    rmodel, rtok = oracle.load(path)
    from mlx_lm.generate import generate as ref_generate
    want = ref_generate(rmodel, rtok, "def f(x):", max_tokens=20)
    got = engine.generate(model, tok, "def f(x):", max_tokens=20, temperature=0.0,
                          levers=resolve("l3", env={}))
    assert got.text == want


@pytest.mark.parametrize("family", ["gemma4_text", "minicpm"])
def test_uncovered_models_fall_back_to_l1(family):
    path = ensure_fixture(family, "bfloat16")
    model = load_model(path)[0]
    assert why_not(model) is not None
    assert decoder_for(model, resolve("l3", env={})) is None
    _assert_same(list(generate_step(mx.array(PROMPT), model, max_tokens=8)), _ref_steps(path, 8))


def test_engine_l3_decodes_every_batch_row_on_the_fast_runner():
    """`Engine(levers=l3)`: every batch row decodes on the fast runner, max_batch 1 included
    (requests are then batch rows, not solo); on the CPU its tokens are the L1 engine's
    greedy tokens (and a single request's text is mlx-lm's)."""
    path = str(ensure_fixture("llama", "bfloat16"))
    model, tok = engine.load(path)
    l1_model, l1_tok = engine.load(path)          # (l3 merges the projections in place)
    rmodel, rtok = oracle.load(path)
    from mlx_lm.generate import generate as ref_generate
    want = ref_generate(rmodel, rtok, "def f(x):", max_tokens=12)
    lv = resolve("l3", env={})
    prompts = ["def f(x):", "count to ten", "the quick brown fox", "import numpy as"]

    def run(m, t, max_batch, levers, ps):
        eng = engine.Engine(m, t, max_batch=max_batch, levers=levers)
        ids = [eng.submit(p, engine.SamplingParams(max_tokens=12, temperature=0.0)) for p in ps]
        text, toks = {i: "" for i in ids}, {i: [] for i in ids}
        while eng.has_unfinished():
            for o in eng.step():
                text[o.request_id] += o.text
                toks[o.request_id] += list(o.token_ids)
        return [text[i] for i in ids], [toks[i] for i in ids], eng

    # max_batch 1: the request is a batch row on the fast runner
    (solo,), (solo_toks,), eng = run(model, tok, 1, lv, prompts[:1])
    assert eng.fast_step is not None
    assert eng.stats()["lanes"] == {"batch": 1, "solo": 0}
    steps, row_steps = eng.stats()["fast"]["steps"], eng.stats()["fast"]["row_steps"]
    assert steps >= 11 and solo == want
    # max_batch 4, four requests at once: rows of one batch, each on the fast runner
    texts, toks, eng = run(model, tok, 4, lv, prompts)
    st = eng.stats()
    assert st["lanes"] == {"batch": 4, "solo": 0} and st["peak_rows"] >= 2
    assert st["fast"]["steps"] >= steps + 11
    assert st["fast"]["row_steps"] - row_steps >= 4 * 11       # every row's decode steps
    assert describe(lv, model)["fast_stats"]["steps"] == st["fast"]["steps"]   # the one kept step
    ref_texts, ref_toks, ref = run(l1_model, l1_tok, 4, None, prompts)
    assert ref.fast_step is None and ref.stats()["fast"] is None
    assert toks == ref_toks and texts == ref_texts
    assert all(len(t) == 12 for t in toks) and texts[0] == want
