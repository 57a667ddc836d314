"""A burst of long prompts shares one prefill budget a step (`Engine(prefill_budget=)`, default
`prefill_step_size`), so the rows already decoding wait for at most ~budget prompt tokens per
step instead of rows x `prefill_step_size` (mlx-lm's BatchGenerator schedule, `prefill_budget=0`).
On the CPU the chunking does not change any row's tokens or logprobs with full attention; on
sliding-window models it would (the rings round differently), so there the chunks stay whole and
the budget bounds the rows prefilling together."""

import numpy as np
import pytest

from engine import Engine, SamplingParams
from engine.loader import load
from parity.fixtures.models import ensure_fixture

STEP = 256


def _burst(eng, n=6, length=600, gen=6):
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=gen, temperature=0.0, logprobs=True, top_logprobs=5)
    rids = [eng.submit(rng.integers(4, 900, size=length - 37 * i).tolist(), params)
            for i in range(n)]
    out = {r: ([], []) for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprobs)
    return [out[r] for r in rids]


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("qwen3", "bfloat16")])
def test_budget_keeps_every_row_and_bounds_the_step(family, dtype, monkeypatch):
    path = ensure_fixture(family, dtype)
    model, tok = load(str(path))
    seen = []
    cls = type(model)
    real = cls.__call__

    def spy(self, inputs, *a, **kw):
        if inputs.ndim == 2 and inputs.shape[1] > 1:
            seen.append(inputs.shape[0] * inputs.shape[1])
        return real(self, inputs, *a, **kw)
    monkeypatch.setattr(cls, "__call__", spy)
    runs = {}
    for budget in (0, -1):
        seen.clear()
        eng = Engine(model, tok, max_batch=8, prefill_step_size=STEP, prefill_budget=budget,
                     prompt_cache=None)
        runs[budget] = (_burst(eng), max(seen))
    (plain, widest_plain), (shared, widest_shared) = runs[0], runs[-1]
    assert widest_plain >= 6 * STEP            # BatchGenerator's schedule: rows x step size
    assert widest_shared <= STEP + 6 * 64      # shared: the budget (rows padded to 64 at least)
    assert shared == plain                     # every row's tokens and logprobs


def _spied(monkeypatch, model):
    """The prefill forwards' input shapes (rows, tokens) of `model`, as they run."""
    shapes = []
    cls = type(model)
    real = cls.__call__

    def spy(self, inputs, *a, **kw):
        if inputs.ndim == 2 and inputs.shape[1] > 1:
            shapes.append(tuple(inputs.shape))
        return real(self, inputs, *a, **kw)
    monkeypatch.setattr(cls, "__call__", spy)
    return shapes


def _alone(model, tok, prompt, params):
    eng = Engine(model, tok, max_batch=1, prefill_step_size=STEP, prompt_cache=None)
    eng.submit(prompt, params)
    toks, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            toks.extend(o.token_ids)
            lps.extend(o.logprobs)
    return toks, lps


def test_sliding_window_models_keep_whole_chunks_and_prefill_rows_within_the_budget(monkeypatch):
    """Gemma 3 text (sliding-window layers): each row's prompt chunks stay BatchGenerator's
    (prefill_step_size each: the rings would round differently otherwise), and the budget
    bounds the rows prefilling together: a burst of long prompts prefills one row at a time,
    chunk by chunk, while short prompts still prefill together. Control: budget 0 prefills
    the burst's rows all in one forward."""
    model, tok = load(str(ensure_fixture("gemma3_text", "float32")))
    eng = Engine(model, tok, max_batch=8, prefill_step_size=STEP, prompt_cache=None)
    assert eng.prefill_budget == STEP and eng.whole_chunks
    assert not Engine(*load(str(ensure_fixture("llama", "float32"))), max_batch=8,
                      prefill_step_size=STEP).whole_chunks
    shapes = _spied(monkeypatch, model)
    shared = _burst(eng, n=4)
    assert shapes and all(r == 1 and t <= STEP for r, t in shapes)   # one row, whole chunks
    assert max(t for _, t in shapes) == STEP
    shapes.clear()
    _burst(Engine(model, tok, max_batch=8, prefill_step_size=STEP, prefill_budget=0,
                  prompt_cache=None), n=4)
    assert max(r * t for r, t in shapes) == 4 * STEP          # the control: four rows at once
    # the first row prefilled alone in whole chunks: its first token and logprobs are its
    # run alone's (later ones may move as the next rows join its decode: docs/batching.md)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5)
    toks, lps = _alone(model, tok, np.random.default_rng(0).integers(4, 900, size=600).tolist(),
                       params)
    assert shared[0][0][0] == toks[0] and shared[0][1][0] == lps[0]
    # short prompts: several rows in one forward, within the budget
    shapes.clear()
    short = Engine(model, tok, max_batch=8, prefill_step_size=STEP, prompt_cache=None)
    rng = np.random.default_rng(1)
    for i in range(6):
        short.submit(rng.integers(4, 900, size=30 + i).tolist(), SamplingParams(max_tokens=2))
    while short.has_unfinished():
        short.step()
    assert shapes[0][0] == 6 and shapes[0][0] * shapes[0][1] <= STEP
