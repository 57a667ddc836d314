"""Prompt-lookup speculation for rows of the continuous batch (`engine.step.batch`, L1), and
the verify step that draft-model rows share (`engine.step.batch_draft`: their drafts come from
the draft model, batched, before the verify forward; its caches are rewound after it).

A row that asks for it (`BatchRequest(lookup=RowLookup(ngram, draft_tokens))`; greedy, or
sampled since 0.5.3: a draft kept when the row's own draw equals it, as a draft-model row's;
its logits processors processed at every position, `processed_positions`) drafts from its own
prompt and output at each decode step, as
`engine.step.lookup` does for a request running alone: up to K tokens that followed the latest
earlier occurrence of its last `ngram` tokens. When any row of the decode group has a draft,
the step is one verify forward over [B, K + 1] (K the longest draft this step): each row's
current token, then its draft, padded to K; a row without a draft (or without speculation)
carries padding after its token, whose logits are not read. Every row samples its position 0
as a plain decode step would (its own sampler, key and processors); a speculating row keeps
the drafts equal to the argmax before them and takes the argmax after the last kept one as its
next token. The rejected (and padded) columns are then taken back from each row's KV
(`BatchKVCache.rewind`), so every row's cache holds exactly its tokens, as after plain steps.
Rows thus advance by different numbers of tokens in one step; a row that finishes inside its
accepted run (EOS, stop token or string, max_tokens) hands out nothing after that token, and
the KV it hands over is trimmed to the tokens it handed out.

Exactness: where a forward over several positions gives each position the logits a single
step gives (the CPU, full attention: tests/engine/test_batch_lookup.py), every row's tokens and
logprobs equal those of the batch without speculation. Costs: the step waits for the previous
forward (a draft is looked up after the current token is known), each row's KV is rolled
once per verify step in which rows keep different numbers of tokens (a gather of the whole
cache), and rows without drafts compute K padded positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

from engine.step.batch_draft import DraftRow
from engine.step.lookup import NgramIndex
from engine.step.sampling import greedy
from engine.step.speculation import SpecStats

__all__ = ["RowLookup", "LookupRow", "LookupSteps"]


@dataclass
class RowLookup:
    """A batch row's prompt-lookup settings. limit: tokens the row may hand out in all (its
    drafts never reach past it; None: the row's `max_tokens`); stats: its counters
    (`engine.step.speculation.SpecStats`, e.g. `Speculation.for_request("lookup")`)."""

    ngram: int
    draft_tokens: int = 4
    limit: Optional[int] = None
    stats: Optional[SpecStats] = None

    def __post_init__(self):
        if self.ngram < 1 or self.draft_tokens < 1:
            raise ValueError("prompt lookup needs ngram >= 1 and draft_tokens >= 1")


class LookupRow:
    """One row's drafting state: the n-gram index of its tokens (built at its first draft)."""

    def __init__(self, lookup: RowLookup, max_tokens: Optional[int]):
        self.lookup = lookup
        self.limit = lookup.limit if lookup.limit is not None else max_tokens
        self.stats = lookup.stats if lookup.stats is not None else SpecStats()
        self.index: Optional[NgramIndex] = None

    def propose(self, tokens: list, y: int, n: int) -> list:
        """The draft after the row's current token y (not yet handed out): `tokens` are the
        ones in its cache, n the tokens it handed out so far."""
        if self.index is None:
            self.index = NgramIndex(tokens, self.lookup.ngram)
        self.index.append(y)
        k = self.lookup.draft_tokens
        if self.limit is not None:
            k = min(k, self.limit - n - 1)
        return self.index.propose(k)

    def accept(self, drafts: list) -> None:
        for t in drafts:
            self.index.append(t)


def accepted(r, drafts: list, best: list, first: int, lp: mx.array) -> tuple:
    """(drafts kept, the token after them) for row r: greedy, the drafts equal to the argmax
    (`best`, per position) before them; sampled (a draft-model row), the drafts equal to the
    row's own draw at their position (mlx-lm's scheme: every token handed out is the target's
    sample), `first` the draw at position 0 and each later one taken with the row's sampler and
    key only when the one before was kept, so a seeded row draws exactly the keys it would
    without speculation."""
    if r.sampler is greedy:
        ok = 0
        while ok < len(drafts) and best[ok] == drafts[ok]:
            ok += 1
        return ok, best[ok]
    rule = getattr(r.spec, "rule", None)
    if rule is not None and drafts:      # (a rejection-sampled draft row: engine.step.rejection)
        tokens, ok = rule.verify(lp[:len(drafts) + 1], mx.array(drafts), r.spec.qs[:len(drafts)],
                                 r.split_key())
        return ok, tokens[ok]
    ok, t = 0, first
    while ok < len(drafts) and t == drafts[ok]:
        ok += 1
        t = r.sample(lp[ok][None]).item()
    return ok, t


def processed_positions(lp: mx.array, spec: list, rows: list, drafts: list, ys: list,
                        logprobs: mx.array, logits: mx.array) -> mx.array:
    """The speculating rows' verify logprobs [S, K + 1, V] (`lp`, rows `spec` of the group)
    with each row that has logits processors processed as single steps would be: position 0
    the step's own processed logprobs (`logprobs` [B, V]); position i the logits through the
    row's processors in order, a grammar masking as after the row's first i drafts
    (`GrammarProcessor.masks_ahead`, its own `where`), a built-in penalty or bias called with
    the context a single step would see there (its tokens, y, drafts[:i]); then the same
    normalisation. A
    row's drafts (`drafts`, changed in place) are cut where a grammar stops taking them."""
    out = []
    V = logits.shape[-1]
    for j, e in enumerate(spec):
        procs = rows[e].req.logits_processors
        if not procs:
            out.append(lp[j])
            continue
        ahead = {id(p): p.masks_ahead(drafts[e], V) for p in procs if hasattr(p, "masks_ahead")}
        n = min((len(m) for m in ahead.values()), default=len(drafts[e]))
        drafts[e] = drafts[e][:n]
        before = rows[e].tokens + [ys[e]]
        pos = [logprobs[e]]
        for i in range(n):          # position i + 1: the input drafts[i]
            x = logits[e:e + 1, i + 1]
            ctx = mx.array(before + drafts[e][:i + 1], dtype=mx.int32)
            for p in procs:
                x = (mx.where(mx.array(ahead[id(p)][i]), x, mx.array(-float("inf"), x.dtype))
                     if id(p) in ahead else p(ctx, x))
            pos.append((x - mx.logsumexp(x, axis=-1, keepdims=True))[0])
        out.append(mx.concatenate([mx.stack(pos), lp[j, n + 1:]]))
    return mx.stack(out)


class LookupSteps:
    """Mixed into `engine.step.batch.BatchScheduler`: `_lookup_step`, the decode step of a
    group in which rows speculate (its rows' `spec`: a `LookupRow`, a
    `engine.step.batch_draft.DraftRow` or None; `g.draft`: the group's `DraftBatch` or None)."""

    draft_max_rows: Optional[int] = None    # (BatchScheduler's: drafting pauses above it)

    def drafting_paused(self, g) -> bool:
        """Whether group g's step skips speculation: more rows than `draft_max_rows` decode and
        every speculating row is a draft-model row whose tokens do not depend on its drafts
        (greedy, or mlx-lm's exact scheme; not prompt lookup, not rejection sampling). The step
        is then a plain one; the drafts catch up when drafting resumes (`DraftBatch.pause`)."""
        if g.draft is None or self.draft_max_rows is None or len(g.rows) <= self.draft_max_rows:
            return False
        if any(r.spec is not None and (not isinstance(r.spec, DraftRow) or r.spec.rule is not None)
               for r in g.rows):
            return False
        g.draft.pause()
        return True

    def _lookup_step(self, g) -> Optional[List]:
        """One verify step of group g when a row has a draft (its events), else None (every
        speculating row counts a forward with no draft, and the plain step runs)."""
        rows = g.rows
        inputs, cur_lp = g.next_tokens, g.next_logprobs
        ys = inputs.tolist()      # (waits for the previous forward: drafts follow y)
        if g.draft is not None:   # draft-model rows' drafts, batched (engine.step.batch_draft)
            g.draft.propose(rows, ys)
        drafts = [r.spec.propose(r.tokens, y, r.n) if r.spec is not None else []
                  for r, y in zip(rows, ys)]
        K = max(len(d) for d in drafts)
        if K == 0:
            for r in rows:
                if r.spec is not None:
                    r.spec.stats.record(0, 0)
            return None
        tokens = [[y] + [t or 0 for t in d] + [0] * (K - len(d)) for y, d in zip(ys, drafts)]
        tokens = g.draft.placed(rows, tokens) if g.draft is not None else mx.array(tokens)
        # the fast runner's slot pool verifies each row's own tokens only (engine.fast.slots)
        pool = g.caches if hasattr(g.caches, "verify") else None
        logits = (pool.verify(tokens, [1 + len(d) for d in drafts]) if pool is not None
                  else self._forward(g, tokens))                   # [B, K + 1, V]
        sampled, logprobs = self._sample(g, inputs, logits[:, 0, :])
        spec = [e for e, r in enumerate(rows) if r.spec is not None]
        lp = logits[mx.array(spec)]
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        best = mx.argmax(lp, axis=-1)
        mx.eval(sampled, best, cur_lp)
        sampled, best = sampled.tolist(), dict(zip(spec, best.tolist()))
        if g.draft is not None:         # (the draft-model rows' drafts, read back only now)
            g.draft.read()
            drafts = [r.spec.proposed if isinstance(r.spec, DraftRow) else d
                      for r, d in zip(rows, drafts)]
        if any(rows[e].req.logits_processors for e in spec):   # (grammars, penalties, bias)
            lp = processed_positions(lp, spec, rows, drafts, ys, logprobs, logits)
            best = mx.argmax(lp, axis=-1)
            best = dict(zip(spec, best.tolist()))
        runs, nxt, nlp, drop = [], [], [], []
        for e, (r, y, d) in enumerate(zip(rows, ys, drafts)):
            run = [(y, cur_lp[e])]
            if r.spec is None:
                nxt.append(sampled[e])
                nlp.append(logprobs[e])
                drop.append(K)
            else:
                j = spec.index(e)
                ok, t = accepted(r, d, best[e], sampled[e], lp[j])
                r.spec.stats.record(len(d), ok)
                r.spec.accept(d[:ok])
                run += [(d[a], lp[j, a]) for a in range(ok)]
                nxt.append(t)
                nlp.append(lp[j, ok])
                drop.append(K - ok)
            runs.append(run)
        for c in [pool] if pool is not None else g.caches:
            c.rewind(drop)
        if g.draft is not None:
            g.draft.rewind()
        g.next_tokens, g.next_logprobs = mx.array(nxt, dtype=inputs.dtype), nlp
        mx.async_eval(g.next_tokens, g.next_logprobs)
        events, keep = [], []
        for e, (r, run) in enumerate(zip(rows, runs)):
            for a, (tok, tlp) in enumerate(run):
                if not self._emit(g, e, r, tok, tlp, events, extra=len(run) - 1 - a):
                    break
            else:
                keep.append(e)
        if len(keep) < len(g):
            g.filter(keep)
        return events
