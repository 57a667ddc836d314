"""A burst of long prompts shares one prefill budget a step (`Engine(prefill_budget=)`, default
`prefill_step_size`), so the rows already decoding wait for at most ~budget prompt tokens per
step instead of rows x `prefill_step_size` (mlx-lm's BatchGenerator schedule, `prefill_budget=0`).
On the CPU the chunking does not change any row's tokens or logprobs with full attention; on
sliding-window models it would (the rings round differently), so there the budget is off."""

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


def test_sliding_window_models_keep_batchgenerators_schedule():
    model, tok = load(str(ensure_fixture("gemma3_text", "float32")))
    assert Engine(model, tok, max_batch=8, prefill_step_size=STEP).prefill_budget == 0
    model, tok = load(str(ensure_fixture("llama", "float32")))
    assert Engine(model, tok, max_batch=8, prefill_step_size=STEP).prefill_budget == STEP
