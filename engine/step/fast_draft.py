"""The draft model's decode steps on the fast runner: L3 kernels for the drafts only.

A draft only proposes: the model verifies every draft in its own forward (L1) and keeps a
greedy row's draft only where it equals the model's own choice, so where the draft's steps
run changes how many drafts are kept, never a greedy row's tokens or logprobs. On a GPU the
draft's own forward costs about what the model's does (a small model's step is kernel
launches, not arithmetic), which is why a draft model did not pay there
(reports/spec_rounds/). `FastDraftBatch` is the batch runner's `DraftBatch` with the
drafting rows' KV in a slot pool (`engine.fast.slots.SlotPool`) and every draft step the fast
runner's step (`engine.fast.decode.FastStep`: on CUDA one kernel a step for a model that
small). What stays the same: the rows' catch-up prefill (the draft model's own forward into
its own caches, then copied into a slot), the drafts left on the device for the verify
forward, and each row's bookkeeping (`DraftRow`). A rejected draft leaves the pool by moving
its row's column back (`SlotPool.rewind`).

Sampled rows: under the exact scheme a batch row's tokens are those it samples without
speculation whatever is drafted; under rejection sampling the drafts become tokens, drawn
from the fast step's logits (its distribution is the one kept as q, so the model's
distribution is kept; the tokens are not the L1 draft's).

Where the fast step does not cover the draft model (`engine.fast.decode.why_not`), or
without `draft_levers`, the draft runs as before (`Engine(draft_levers=...)`).
"""

from __future__ import annotations

from typing import List

import mlx.core as mx

from engine.fast.slots import SlotPool
from engine.kv.batch_cache import batch_caches
from engine.step.batch_draft import DraftBatch


CATCH_UP = 2      # a row's tokens fed one fast step each (more: the draft's own forward first)


class FastDraftBatch(DraftBatch):
    """`DraftBatch` over a `SlotPool` of the draft model's fast step `step`."""

    def __init__(self, model, step, prefill_step_size: int = 2048):
        super().__init__(model, prefill_step_size)
        self.pool = SlotPool(step, model)

    def held_bytes(self) -> int:
        return self.pool.nbytes

    def keep_kv(self, idx: List[int]) -> None:
        self.pool.filter(idx)

    def join_kv(self, caches: list) -> None:
        self.pool.extend(batch_caches(caches))

    def first_logits(self, inputs: List[list]) -> mx.array:
        """The fast step once a token: a row with fewer tokens than the longest feeds its
        first one in the steps before its own start, each taken back after the step (so its
        last token is fed in the last step, with everyone's). A row with more than
        `CATCH_UP` (drafting resumed after a pause) first takes all but its last through
        the draft model's own forward over its KV, put back into its slot."""
        for i, x in enumerate(inputs):
            if len(x) > CATCH_UP:
                caches = self.pool.extract(i)
                self.model(mx.array(x[:-1])[None], cache=caches)
                self.pool.replace(i, caches)
                inputs = inputs[:i] + [x[-1:]] + inputs[i + 1:]
        P = max(len(x) for x in inputs)
        logits = None
        for j in range(P):
            back = [1 if j < P - len(x) else 0 for x in inputs]
            toks = [x[0] if b else x[j - (P - len(x))] for x, b in zip(inputs, back)]
            logits = self.pool(mx.array(toks, dtype=mx.int32))
            if any(back):
                self.pool.rewind(back)
        return logits

    def next_logits(self, tokens: mx.array) -> mx.array:
        return self.pool(tokens)

    def take_back(self, drop: List[int]) -> None:
        self.pool.rewind(drop)
