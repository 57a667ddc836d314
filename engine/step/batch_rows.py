"""The rows of the batch runner (`engine.step.batch.BatchScheduler`) and the groups of rows
that share batched caches (one prefill group, one decode group)."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from engine.kv.batch_cache import extend_caches
from engine.step.batch_draft import DraftRow
from engine.step.batch_lookup import LookupRow
from engine.step.batch_types import BatchRequest
from engine.step.sampling import greedy
from engine.text.stop import TextStream

__all__ = ["Row", "Group", "pooled", "extract_row", "guarded", "clone_cache", "eval_caches"]


class Row:
    __slots__ = ("uid", "req", "pending", "last", "tokens", "n", "key", "stops",
                 "text", "cancelled", "error", "spec", "embeds", "at", "early", "retired")

    def __init__(self, uid: int, req: BatchRequest, stops: set, tokenizer):
        self.uid, self.req = uid, req
        prompt = list(req.prompt)
        self.pending = prompt[:-1]        # prefilled in chunks
        self.last = prompt[-1]            # fed as the first decode step
        self.embeds = req.embeddings      # the prompt's input embeddings (images), until used
        self.at = 0                       # prompt tokens prefilled
        self.tokens = list(req.history)   # tokens in the row's cache (processor context)
        self.n = 0
        self.key = mx.random.key(req.seed) if req.seed is not None else None
        self.stops = stops
        self.text = None
        self.cancelled = False
        self.early = False        # its first token went out at graduation (not yet decoded)
        self.retired = False      # retired while early: leaves after its next forward
        self.error: Optional[BaseException] = None   # raised by this row's own code
        self.spec = (LookupRow(req.lookup, req.max_tokens) if req.lookup is not None
                     else DraftRow(req.draft, req.max_tokens, req.seed, req.sampler) if req.draft is not None
                     else None)
        if tokenizer is not None:
            stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
            self.text = TextStream(tokenizer, stop)
        elif req.stop:
            raise ValueError("stop strings need a tokenizer")

    @property
    def sampler(self):
        return self.req.sampler or greedy

    def sample(self, logprobs):
        sub = self.split_key()
        return self.sampler(logprobs) if sub is None else self.sampler(logprobs, key=sub)

    def split_key(self):
        """The row's next PRNG key (None: the row draws from the global PRNG)."""
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


def pooled(caches) -> bool:
    """Whether a group's caches are the fast runner's slot pool (engine.fast.slots.SlotPool)
    rather than a list of per-layer batch caches."""
    return not isinstance(caches, list)


def extract_row(caches, i: int) -> list:
    """Row i of a group's caches as single-row caches (one per layer)."""
    return caches.extract(i) if pooled(caches) else [c.extract(i) for c in caches]


class Group:
    """Rows that share batched caches (one prefill group, one decode group). The decode
    group of the fast runner keeps its rows' KV in a slot pool (`caches` is then an
    `engine.fast.slots.SlotPool`, for the group's lifetime)."""

    def __init__(self, caches=None):
        self.rows: List[Row] = []
        self.caches = [] if caches is None else caches
        self.next_tokens = None            # decode group: [B] sampled, not yet emitted
        self.next_logprobs: list = []
        self.procs_key = None              # row uids `procs` was built for
        self.procs = None                  # row_processors.batched(rows' processors)
        self.draft = None                  # decode group: its rows' draft caches (DraftBatch)

    def __len__(self):
        return len(self.rows)

    def filter(self, keep: List[int]):
        self.rows = [self.rows[i] for i in keep]
        if self.draft is not None:         # (the rows that left: their draft caches freed)
            self.draft.keep(self.rows)
        if pooled(self.caches):
            self.caches.filter(keep)
        elif not keep:
            self.caches = []
        else:
            for c in self.caches:
                c.filter(keep)
        if not keep:
            self.next_tokens, self.next_logprobs = None, []
            return
        if self.next_tokens is not None:
            self.next_tokens = self.next_tokens[mx.array(keep)]
            self.next_logprobs = [self.next_logprobs[i] for i in keep]

    def take(self, idx: List[int]) -> "Group":
        """Split rows idx (sorted) off into a new group."""
        out = Group()
        out.rows = [self.rows[i] for i in idx]
        out.caches = [clone_cache(c) for c in self.caches]
        for c in out.caches:
            c.filter(idx)
        rest = [i for i in range(len(self.rows)) if i not in set(idx)]
        self.filter(rest)
        return out

    def extend(self, other: "Group"):
        self.rows.extend(other.rows)
        self.caches = (self.caches.extend(other.caches) if pooled(self.caches)
                       else extend_caches(self.caches, other.caches))
        if other.next_tokens is not None:
            self.next_tokens = (other.next_tokens if self.next_tokens is None
                                else mx.concatenate([self.next_tokens, other.next_tokens]))
            self.next_logprobs.extend(other.next_logprobs)


def guarded(row: "Row", fn, fallback, *args):
    """fn(*args) for one row's own code (its processors, sampler, detokenizer): an
    exception marks the row failed (it ends with finish_reason "error" at its next
    event) and `fallback(*args)` stands in, so the other rows' step goes on."""
    if row.error is None:
        try:
            return fn(*args)
        except Exception as e:
            row.error = e
    return fallback(*args)


def clone_cache(c):
    n = type(c).__new__(type(c))
    n.__dict__.update(c.__dict__)
    return n


def eval_caches(caches):
    mx.eval([a for c in caches for a in c.state if a is not None])
