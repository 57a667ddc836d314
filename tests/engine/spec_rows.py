"""Shared by the speculating-row tests (test_batch_lookup.py, test_batch_draft.py): run one
request as a row of an Engine's batch, beside a plain greedy row, and watch its steps; step an
Engine to the end collecting each request's tokens and logprob arrays."""

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


def drive(eng, rids) -> list:
    """Step `eng` (made with keep_logprob_arrays) until it is done: per request id of `rids`,
    (its tokens, its logprob arrays); an output with an error fails the test."""
    out = {r: ([], []) for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprob_arrays)
    return [out[r] for r in rids]
