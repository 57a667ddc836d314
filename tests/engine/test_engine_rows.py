"""`Engine.stats()` row counters: `rows_now` (rows decoding now) and `peak_rows` (the
most rows that ran one decode forward together), not rows handed to the batch.

The model is watched from outside: the largest batch of any one-token forward (a
decode step, or the first decode step of rows leaving prefill, which the next decode
step then runs with the rest) is what `peak_rows` must end at, and never exceed on
the way (qwen3 fixture)."""

import pytest

import engine
from engine import Engine, SamplingParams
from parity.fixtures.models import ensure_fixture


class Watched:
    """The model, recording the batch size of every one-token forward."""

    def __init__(self, model):
        self.inner, self.one_token = model, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, inputs, cache=None, **kw):
        if inputs.shape[1] == 1:
            self.one_token.append(inputs.shape[0])
        return self.inner(inputs, cache=cache, **kw)


@pytest.fixture(scope="module")
def qwen():
    return engine.load(str(ensure_fixture("qwen3", "bfloat16")))


def _run(eng, model):
    """Step to the end; per step (largest one-token forward so far, rows_now, peak_rows)."""
    seen = []
    while eng.has_unfinished():
        eng.step()
        st = eng.stats()
        seen.append((max(model.one_token, default=0), st["rows_now"], st["peak_rows"]))
    return seen


@pytest.mark.parametrize("n, max_batch, peak", [(8, 4, 4), (2, 4, 2)])
def test_peak_rows_counts_rows_decoding_together(qwen, n, max_batch, peak):
    model, tok = Watched(qwen[0]), qwen[1]
    eng = Engine(model, tok, max_batch=max_batch)
    for i in range(n):
        eng.submit(tok.encode(f"row {i} says"), SamplingParams(max_tokens=6))
    seen = _run(eng, model)
    for most, now, p in seen:       # step by step: never above what the model ran, nor N
        assert p <= most <= max_batch and now <= max_batch
    st = eng.stats()
    assert max(model.one_token) == peak
    assert st["peak_rows"] == peak and st["rows_now"] == 0 and st["active_rows"] == 0


def test_rows_handed_over_but_never_decoding_together_are_not_a_peak(qwen):
    """A short request decodes to its end while a long prompt is still prefilling (16
    tokens a step): both were handed to the batch at once (`active_rows` 2), but no
    decode forward ever held two rows, so peak_rows is 1."""
    model, tok = Watched(qwen[0]), qwen[1]
    eng = Engine(model, tok, max_batch=2, prefill_step_size=16)
    eng.submit(tok.encode("short"), SamplingParams(max_tokens=3))
    eng.submit(tok.encode("long " * 200), SamplingParams(max_tokens=3))
    eng.step()
    assert eng.stats()["active_rows"] == 2
    _run(eng, model)
    assert max(model.one_token) == 1 and eng.stats()["peak_rows"] == 1


def test_solo_lane_decodes_one_row(qwen):
    model, tok = Watched(qwen[0]), qwen[1]
    eng = Engine(model, tok, max_batch=1)
    eng.submit(tok.encode("alone"), SamplingParams(max_tokens=4))
    nows = []
    while eng.has_unfinished():
        eng.step()
        nows.append(eng.stats()["rows_now"])
    assert max(nows) == 1 and nows[-1] == 0 and eng.stats()["peak_rows"] == 1


def test_first_token_in_the_step_the_row_graduates(qwen):
    """A batch row's first token is handed out by the step that ran its last prompt token
    (graduation), not one decode step later; the tokens are those of the pipelined
    scheduler (`first_at_graduate=False`, BatchGenerator's timing)."""
    model, tok = qwen
    prompt = list(range(5, 40))
    got = {}
    for early in (True, False):
        eng = Engine(model, tok, max_batch=2)
        eng._sched.first_at_graduate = early
        rid = eng.submit(prompt, SamplingParams(max_tokens=4, temperature=0.0))
        steps, toks = [], []
        while eng.has_unfinished():
            outs = [o for o in eng.step() if o.request_id == rid]
            steps.append(sum(len(o.token_ids) for o in outs))
            toks += [t for o in outs for t in o.token_ids]
        got[early] = (steps, toks)
    (early_steps, early_toks), (late_steps, late_toks) = got[True], got[False]
    assert early_toks == late_toks and len(early_toks) == 4
    assert early_steps.index(1) == 1 and late_steps.index(1) == 2   # prefill, then graduate


def test_first_at_graduate_runs_the_same_forwards(qwen):
    """Rows ending at their first token (max_tokens 1) beside decoding rows: every
    one-token forward has the batch it has with BatchGenerator's timing (a row that ended
    at graduation still runs in the next decode forward); negative control: retiring it at
    once changes them."""
    from engine.step import batch

    def forwards(early, defer=True):
        model = Watched(qwen[0])
        eng = Engine(model, qwen[1], max_batch=4)
        eng._sched.first_at_graduate = early
        plan = {0: [(list(range(5, 30)), 8), (list(range(7, 20)), 1)], 3: [(list(range(9, 40)), 1)],
                5: [(list(range(3, 12)), 6), (list(range(4, 9)), 1)]}
        step = 0
        while step <= max(plan) or eng.has_unfinished():
            for prompt, m in plan.get(step, ()):
                eng.submit(prompt, SamplingParams(max_tokens=m, temperature=0.0))
            eng.step()
            step += 1
        return model.one_token

    assert forwards(True) == forwards(False)
    retire = batch.BatchScheduler.retire

    def at_once(self, uids):
        for r in self._decode.rows:
            r.early = r.early and r.uid not in uids     # (those retired leave now)
        return retire(self, uids)
    batch.BatchScheduler.retire = at_once
    try:
        assert forwards(True) != forwards(False)
    finally:
        batch.BatchScheduler.retire = retire
