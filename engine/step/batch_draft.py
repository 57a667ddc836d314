"""Draft-model speculation for rows of the continuous batch (`engine.step.batch`, L1).

A row that asks for it (`BatchRequest(draft=RowDraft(draft_tokens))`, without logits
processors, on a scheduler built with `draft_model=`) gets its drafts from a second, smaller
model of the same vocabulary: at each decode step the draft model proposes up to K tokens for
every drafting row at once (`DraftBatch.propose`: K batched forwards over the drafting rows;
a greedy row's drafts are the argmax, a sampled row's drawn with its sampler from a key stream
of its own, `DraftRow.draw`), then the target verifies them in the batch's one forward over
[B, K + 1] as prompt-lookup rows are verified (`engine.step.batch_lookup.LookupSteps._lookup_step`:
the drafts equal to the argmax before them are kept, then the argmax after the last kept one;
for a sampled row, the drafts equal to its own draw at their position, mlx-lm's scheme,
`batch_lookup.accepted`; the rejected and padded columns leave the target's KV by
`BatchKVCache.rewind`). Rows with lookup drafts and rows without speculation share the step.
The drafts stay on the device until the verify forward has run (`placed`, `read`): the host
builds that forward while the draft's run, and reads both back at once.

The draft keeps its own batched caches for its rows (`DraftBatch.caches`, the same
`engine.kv.batch_cache` classes as the target's): a row's are filled with every token in the
row's target caches (its whole prompt, a prompt-cache prefix included) from its first decode
step on, at most `prefill_step_size` tokens a decode step for all joining rows together (so a
long prompt's draft prefill never stalls the other rows for more than one chunk; the row
decodes without drafts until its caches hold every token before its current one, then joins
the draft's batch), grow by the draft's forwards, and are rewound after verification like the
target's, to the tokens the row keeps: the last draft when every draft was kept is not in
them yet (it was never fed to the draft), so it is fed with the next step's token (mlx-lm's
`speculative_generate_step` does the same). They are freed when the row leaves the decode
group (`keep`, called by `engine.step.batch_rows.Group.filter`).

Exactness: the tokens handed out are the target's argmax (or the row's own draw, each
position's key spent only once the draft before it was kept) at every position, whatever the
draft proposes; so where the verify forward gives each position the logits of a single step
(the CPU, full attention), every row's tokens and logprobs equal those of the batch without
speculation (tests/engine/test_batch_draft.py). The draft's caches only decide which drafts
are proposed (the acceptance), which the same tests check against the draft model run alone.
A rejection-sampled row (`RowDraft(rejection=True)`) keeps drafts by the speculative-sampling
rule (`engine.step.rejection`) from its own keys: its drafts become its tokens, so it draws
only its own drafts and its draft prefill never waits for other rows' (a seeded one repeats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

from engine.kv.batch_cache import batch_caches, extend_caches
from engine.step.rejection import rejection_rule
from engine.step.sampling import greedy
from engine.step.speculation import SpecStats

__all__ = ["RowDraft", "DraftRow", "DraftBatch"]


@dataclass
class RowDraft:
    """A batch row's draft-model settings. draft_tokens: K, the most drafts a step; limit:
    tokens the row may hand out in all (its drafts never reach past it; None: the row's
    `max_tokens`); stats: its counters (`Speculation.for_request("draft")`); rejection: a
    sampled row keeps drafts by the speculative-sampling rule (`engine.step.rejection`)
    instead of mlx-lm's scheme."""

    draft_tokens: int = 3
    limit: Optional[int] = None
    stats: Optional[SpecStats] = None
    rejection: bool = False

    def __post_init__(self):
        if self.draft_tokens < 1:
            raise ValueError("draft-model speculation needs draft_tokens >= 1")


class DraftRow:
    """One row's drafting state (its `Row.spec`): the tokens its draft caches lack before the
    current token (`pending`), this step's proposal and how many of them the draft fed."""

    def __init__(self, draft: RowDraft, max_tokens: Optional[int], seed: Optional[int] = None,
                 sampler=None):
        self.draft = draft
        # the speculative-sampling rule of a rejection-sampled row (None: argmax or mlx-lm's
        # scheme), and this step's drafts' distributions q
        self.rule = rejection_rule(sampler, "rejection") if draft.rejection and sampler else None
        self.qs: list = []
        # a sampled row's draws of the draft (a stream of its own: the row's key is the
        # target's); None: the global PRNG
        self.key = mx.random.split(mx.random.key(seed), 2)[1] if seed is not None else None
        self.limit = draft.limit if draft.limit is not None else max_tokens
        self.stats = draft.stats if draft.stats is not None else SpecStats()
        self.pending: list = []      # tokens before y not yet in the draft's caches
        self.paused_at = None        # len(row tokens) when drafting paused (`DraftBatch.pause`)
        self.proposed: list = []     # this step's drafts (set by DraftBatch.propose)
        self.fed = 0                 # drafts of this step in the draft's caches
        self.kept = 0                # of this step's drafts, accepted by the target

    def wants(self, n: int) -> int:
        """Drafts this step after n tokens handed out (none past the row's limit)."""
        k = self.draft.draft_tokens
        return k if self.limit is None else max(0, min(k, self.limit - n - 1))

    def propose(self, tokens: list, y: int, n: int) -> list:
        return self.proposed

    def accept(self, drafts: list) -> None:
        self.kept = len(drafts)

    def draw(self, sampler, logprobs: mx.array) -> mx.array:
        """A sampled row's draft token from the draft's logprobs [1, V], with the row's sampler
        (a rejection-sampled row's from its rule, keeping q)."""
        sub = None
        if self.key is not None:
            self.key, sub = mx.random.split(self.key)
        if self.rule is not None:
            tok, q = self.rule.draw(logprobs, sub)
            self.qs.append(q)
            return tok
        return sampler(logprobs) if sub is None else sampler(logprobs, key=sub)


class DraftBatch:
    """The draft model's batched caches for the drafting rows of one decode group (in its
    own row order). prefill_step_size: the most tokens of joining rows' draft prefill a step,
    all together; a rejection-sampled row (whose drafts become its tokens, so its tokens depend
    on the step it starts drafting at) gets that many of its own each step, whatever the others
    take, so a seeded one repeats among any rows."""

    def __init__(self, model, prefill_step_size: int = 2048):
        self.model = model
        self.prefill_step_size = prefill_step_size
        self.rows: list = []
        self.caches: list = []
        self.joining: dict = {}      # id(row) -> [row, its caches, tokens fed]: filling up
        self.ran = False             # the draft ran this step (its caches hold drafts)
        self.tokens = None           # this step's drafts [rows, K] (on the device)

    @property
    def nbytes(self) -> int:
        return self.held_bytes() + sum(c.nbytes for j in self.joining.values() for c in j[1])

    def keep(self, rows) -> None:
        """Only `rows` (a group's rows after a filter) stay; the others' caches are freed."""
        live = {id(r) for r in rows}
        self.joining = {k: j for k, j in self.joining.items() if k in live}
        idx = [i for i, r in enumerate(self.rows) if id(r) in live]
        if len(idx) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in idx]
        self.keep_kv(idx)

    # -- where the drafting rows' KV lives (FastDraftBatch: a slot pool instead) ----------

    def held_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def keep_kv(self, idx: List[int]) -> None:
        """Only the KV of rows `idx` (in that order) stays."""
        if not idx:
            self.caches = []
            return
        for c in self.caches:
            c.filter(idx)

    def join_kv(self, caches: list) -> None:
        """Rows whose draft caches (a `KVCache` list each) hold all their tokens join."""
        self.caches = extend_caches(self.caches, batch_caches(caches))

    def first_logits(self, inputs: List[list]) -> mx.array:
        """The draft's logits [B_d, V] after each row's own tokens `inputs` (its pending
        tokens and y: one or more), fed in one forward with the shorter rows right-padded
        (the padding taken back out of the caches)."""
        P = max(len(x) for x in inputs)
        logits = self.model(mx.array([x + [0] * (P - len(x)) for x in inputs]),
                            cache=self.caches)
        logits = logits[mx.arange(len(inputs)), mx.array([len(x) - 1 for x in inputs])]
        if any(len(x) < P for x in inputs):      # the padding leaves the draft's caches
            for c in self.caches:
                c.rewind([P - len(x) for x in inputs])
        return logits

    def next_logits(self, tokens: mx.array) -> mx.array:
        """The draft's logits [B_d, V] after one more token a row (tokens [B_d])."""
        return self.model(tokens[:, None], cache=self.caches)[:, -1, :]

    def _catch_up(self, new: list) -> None:
        """Rows new to the draft start filling their caches; the joining rows (oldest first)
        get at most `prefill_step_size` of their tokens before y fed this step, all together;
        those whose caches then hold every one of them join the draft's batch."""
        for r in new:
            self.joining[id(r)] = [r, self.model.make_cache(), 0]
        budget, ready = self.prefill_step_size, []
        for key, entry in list(self.joining.items()):
            r, caches, fed = entry
            own = getattr(r.spec, "rule", None) is not None     # (see the class docstring)
            n = min(len(r.tokens) - fed, self.prefill_step_size if own else budget)
            if n > 0:
                self.model(mx.array(r.tokens[fed:fed + n])[None], cache=caches)
                mx.eval([c.state for c in caches])
                entry[2] = fed = fed + n
                budget = max(0, budget - n)
            if fed == len(r.tokens):
                del self.joining[key]
                r.spec.pending = []
                ready.append((r, caches))
        if ready:
            self.join_kv([c for _, c in ready])
            self.rows += [r for r, _ in ready]

    def pause(self) -> None:
        """A step without drafting (`LookupSteps.drafting_paused`): each drafting row notes
        where its tokens stand, so the ones handed out meanwhile join its pending tokens when
        drafting resumes (`propose`)."""
        for r in self.rows:
            if r.spec.paused_at is None:
                r.spec.paused_at = len(r.tokens)

    def propose(self, rows: list, ys: List[int]) -> None:
        """Each drafting row's drafts after its current token y (`DraftRow.proposed`), from
        K greedy forwards of the draft over all of them (K the most any row wants)."""
        self.ran = False
        for r in self.rows:          # (after a pause: what was handed out meanwhile)
            if r.spec.paused_at is not None:
                r.spec.pending += r.tokens[r.spec.paused_at:]
                r.spec.paused_at = None
        y_of = {id(r): y for r, y in zip(rows, ys) if isinstance(r.spec, DraftRow)}
        have = {id(r) for r in self.rows} | set(self.joining)
        new = [r for r in rows if id(r) in y_of and id(r) not in have]
        want = {id(r): r.spec.wants(r.n) for r in rows if id(r) in y_of}
        K = max(want.values(), default=0)
        for r in rows:
            if id(r) in y_of:
                r.spec.proposed, r.spec.fed, r.spec.kept, r.spec.qs = [], 0, 0, []
        if K == 0:                   # no draft this step: y waits for the next one
            for r in self.rows:
                r.spec.pending.append(y_of[id(r)])
            return
        if new or self.joining:
            self._catch_up(new)
        if not self.rows:
            return
        logits = self.first_logits([r.spec.pending + [y_of[id(r)]] for r in self.rows])
        wants = [want[id(r)] for r in self.rows]
        drafts = [self._choose(logits, 0, wants)]
        for i in range(1, K):
            drafts.append(self._choose(self.next_logits(drafts[-1]), i, wants))
        # [B_d, K] left on the device: the verify forward takes them from there (`placed`), so
        # the draft runs while the host builds that forward; read back with its results (`read`)
        self.tokens = mx.stack(drafts, axis=1).astype(mx.int32)
        mx.async_eval(self.tokens)
        for r in self.rows:
            r.spec.proposed, r.spec.fed, r.spec.pending = [None] * want[id(r)], K - 1, []
        self.ran = True

    def placed(self, rows: list, tokens: list) -> mx.array:
        """The verify forward's input [B, K + 1] (host `tokens`, one list a row of the group's
        `rows`) with each drafting row's drafts taken from this step's device `tokens`."""
        host = mx.array(tokens)
        if not self.ran:
            return host
        at = {id(r): b for b, r in enumerate(self.rows)}
        B_d = self.tokens.shape[0]
        K_d = min(self.tokens.shape[1], host.shape[1] - 1)   # (K: the most any row wanted)
        src = mx.array([at.get(id(r), B_d) for r in rows])              # (B_d: a zero row)
        drafted = mx.concatenate([self.tokens[:, :K_d], mx.zeros((1, K_d), mx.int32)])[src]
        want = mx.array([len(r.spec.proposed) if id(r) in at else 0 for r in rows])
        keep = mx.arange(K_d)[None] < want[:, None]
        mid = mx.where(keep, drafted, host[:, 1:1 + K_d])
        return mx.concatenate([host[:, :1], mid, host[:, 1 + K_d:]], axis=1)

    def read(self) -> None:
        """The drafts of this step onto the host, each row's `proposed` (after the verify)."""
        if not self.ran:
            return
        for r, d in zip(self.rows, self.tokens.tolist()):
            r.spec.proposed = d[:len(r.spec.proposed)]

    def _choose(self, logits: mx.array, i: int, wants: list) -> mx.array:
        """The draft's i-th token of each of its rows [B_d]: the argmax, or for a sampled row
        that wants an i-th draft (wants[b] > i) a draw with its sampler (`DraftRow.draw`): a row
        spends its draft keys on its own drafts only, however many the other rows want (a
        rejection-sampled row's drafts become its tokens: its draws must not depend on them)."""
        if all(r.sampler is greedy or w <= i for r, w in zip(self.rows, wants)):
            return mx.argmax(logits, axis=-1)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.concatenate([mx.argmax(lp[b:b + 1], axis=-1) if r.sampler is greedy or w <= i
                               else r.spec.draw(r.sampler, lp[b:b + 1]).astype(mx.uint32)
                               for b, (r, w) in enumerate(zip(self.rows, wants))])

    def rewind(self) -> None:
        """After verification: each row's caches keep its token and its accepted drafts (the
        last accepted one waits in `pending` when the draft never fed it)."""
        if not self.ran:
            return
        drop = []
        for r in self.rows:
            s = r.spec
            drop.append(s.fed - min(s.kept, s.fed))
            s.pending = [s.proposed[s.kept - 1]] if s.kept > s.fed else []
        self.ran = False
        if max(drop) > 0:
            self.take_back(drop)

    def take_back(self, drop: List[int]) -> None:
        """The last drop[b] columns leave row b's draft caches (`BatchKVCache.rewind`)."""
        for c in self.caches:
            c.rewind(drop)
