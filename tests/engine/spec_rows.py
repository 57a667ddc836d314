"""Shared by the speculating-row tests (test_batch_lookup.py, test_batch_draft.py): run one
request as a row of an Engine's batch, beside a plain greedy row, and watch its steps."""

from engine import SamplingParams


def run_row(eng, prompt, params, filler=None):
    """Submit `prompt` with `params` (then, unless `filler` is False, a plain greedy 40-token
    row beside it: `filler` its extra params) and step `eng` to the end. Returns the row's
    tokens, its finish reason, the tokens of its last step it did not hand out (`retire`'s
    `unused`) and the tokens it got from each decode step that gave it any."""
    rid = eng.submit(prompt, params)
    if filler is not False:
        eng.submit(list(range(20, 50)), SamplingParams(max_tokens=40, temperature=0.0,
                                                       **(filler or {})))
    dropped, runs = {}, []
    real, real_step = eng._sched.retire, eng._sched.step

    def spy(uids, unused=None):
        dropped.update(unused or {})
        return real(uids, unused)

    def step_spy():
        evs = real_step()
        runs.append(sum(ev.uid == 0 for ev in evs))
        return evs
    eng._sched.retire, eng._sched.step = spy, step_spy
    toks, reason = [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.token_ids
                reason = o.finish_reason or reason
    return toks, reason, dropped.get(0, 0), [n for n in runs if n]
