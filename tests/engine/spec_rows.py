"""Shared by the speculating-row tests (test_batch_lookup.py, test_batch_draft.py,
test_fast_draft.py): run one request as a row of an Engine's batch, beside a plain greedy row,
and watch its steps; step an Engine to the end collecting each request's tokens and logprob
arrays; a draft model's greedy tokens alone, and every proposal of a batch's draft."""

import mlx.core as mx

import engine
from engine import SamplingParams
from engine.step.batch_draft import DraftBatch
from parity.fixtures.models import ensure_fixture

# the speculating-row tests' prompts: repetitive ones (lookup and the drafts find them) and not
REPEATS = [5, 6, 7, 8, 9, 10, 11, 12] * 6
PROMPTS = [REPEATS, list(range(20, 50)), [3, 4, 5, 6, 3, 4, 5, 6, 3, 4] * 3,
           list(range(100, 140)) * 2, REPEATS[5:] + [1, 2]]

# (target, draft) fixtures of the draft-model tests: llama's 4-bit copy; qwen3's 4-bit copies
# draft its answers all right, the `long` bfloat16 variant (its EOS rows scaled) rejects some
DRAFTS = {"llama": ("q4", ""), "qwen3": ("bfloat16", "long")}


def draft_pair(family: str) -> tuple:
    """(model, tokenizer, draft model) of DRAFTS[family], the model in float32."""
    m, tok = engine.load(str(ensure_fixture(family, "float32")))
    dtype, variant = DRAFTS[family]
    d, _ = engine.load(str(ensure_fixture(family, dtype, variant=variant)))
    return m, tok, d


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


def draft_alone(d, context, k):
    """The draft model's greedy k tokens after `context`, alone (one row, fresh caches)."""
    caches = d.make_cache()
    logits = d(mx.array(context)[None], cache=caches)[:, -1, :]
    out = []
    for _ in range(k):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = d(mx.array([[out[-1]]]), cache=caches)[:, -1, :]
    return out


def spy_proposals(monkeypatch) -> list:
    """From now on every proposal of a batch's draft goes into the list returned: (the row's
    tokens before it, its drafts)."""
    seen, real, real_read, asked = [], DraftBatch.propose, DraftBatch.read, []

    def spy(self, rows, ys):            # (the drafts stay on the device until `read`)
        real(self, rows, ys)
        asked[:] = [(r, list(r.tokens) + [y]) for r, y in zip(rows, ys)
                    if r in self.rows and r.spec.proposed]

    def spy_read(self):
        real_read(self)
        seen.extend((context, list(r.spec.proposed)) for r, context in asked)
        asked.clear()
    monkeypatch.setattr(DraftBatch, "propose", spy)
    monkeypatch.setattr(DraftBatch, "read", spy_read)
    return seen
