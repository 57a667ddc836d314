"""Byte-capped LRU of KV prefixes, shared across calls.

An entry is the per-layer cache after some token sequence was fed, stored
under a namespace (the base model, or one adapter stack: caches computed with
different weights must never mix). A lookup returns a *copy* of the entry
with the longest common prefix with the new prompt, trimmed to that prefix
where the cache type allows, always leaving at least one prompt token to
recompute (the last token's logits are needed to sample).

A cache that cannot be trimmed (a sliding-window ring that has wrapped) is
reused only when its whole token sequence is a prefix of the prompt.

Index: one radix tree of token sequences per namespace (`engine.kv.prefix_tree`);
a lookup walks the prompt's path once, so its cost follows the prompt, not the
number of entries. The lock is held for the walk and the index updates only:
the prompt is turned into a tuple before, the hit is copied after (an entry's
arrays are never written to, so one that is evicted meanwhile stays valid for
the copy that holds it).

Size: an entry costs every array its cache objects hold (K/V, a quantized
cache's packed words, scales and biases, at their allocated capacity) plus
`TOKEN_BYTES` per token and `ENTRY_BYTES` + `LAYER_BYTES` per layer for the
Python objects (index nodes, token ids, cache objects). An entry larger than
the whole cap is cut to its longest prefix of whole `BLOCK`-token blocks that
fits (when every layer can be trimmed), so a long agent prefix is still reused
for the part kept; the rest is evicted least recently used first.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .prefix_tree import PrefixTree

BLOCK = 256          # an over-cap prefix is kept in whole blocks of this many tokens
TOKEN_BYTES = 48     # per token: its int object and the index's tuple slots
ENTRY_BYTES = 1024   # per entry: its record and index node
LAYER_BYTES = 768    # per layer: the cache object and its array handles


def cache_arrays(caches) -> list:
    """Every mx.array the cache objects hold (tuples of arrays included)."""
    out = []
    for c in caches:
        for v in vars(c).values():
            if isinstance(v, mx.array):
                out.append(v)
            elif isinstance(v, (tuple, list)):
                out.extend(a for a in v if isinstance(a, mx.array))
    return out


def overhead_bytes(n_tokens: int, n_layers: int) -> int:
    return ENTRY_BYTES + LAYER_BYTES * n_layers + TOKEN_BYTES * n_tokens


def entry_bytes(caches, n_tokens: int) -> int:
    """What an entry of `caches` holding `n_tokens` tokens costs the cap."""
    return sum(a.nbytes for a in cache_arrays(caches)) + overhead_bytes(n_tokens, len(caches))


def _slots(c) -> int:
    k = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
    return k.shape[-2]


def fitting_prefix(caches, n_tokens: int, max_bytes: int) -> int:
    """The longest whole-block prefix of an entry whose cost fits max_bytes once cut
    to it (0 if none)."""
    per_token = TOKEN_BYTES + sum(
        math.ceil(sum(a.nbytes for a in cache_arrays([c])) / _slots(c)) for c in caches
        if c.keys is not None)
    room = max_bytes - overhead_bytes(0, len(caches))
    n = min(n_tokens, int(room // per_token)) // BLOCK * BLOCK
    return max(0, n)


@dataclass
class Hit:
    caches: list          # a private copy, positioned after `reused` tokens
    reused: int           # how many prompt tokens are already in the caches


class _Entry:
    __slots__ = ("eid", "ns", "node", "caches", "size", "arrays", "length")

    def __init__(self, eid, ns, node, caches, size, length):
        self.eid, self.ns, self.node, self.caches = eid, ns, node, caches
        self.size, self.length = size, length
        self.arrays = sum(a.nbytes for a in cache_arrays(caches))


class PromptCache:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = int(max_bytes)
        self._entries: "OrderedDict[int, _Entry]" = OrderedDict()   # LRU order
        self._trees: dict = {}                                      # namespace -> PrefixTree
        self._next_id = 0
        self._bytes = 0
        self.array_bytes = 0  # the part of `bytes` that is MLX arrays
        self.lock = threading.Lock()   # held for index walks and updates, never for copies
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.tokens_reused = 0
        self.cut = 0          # entries stored cut to a prefix (larger than the cap)
        self.ops = 0          # index steps of all lookups (a cost proxy; see prefix_tree)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, namespace: str, prompt: list) -> Optional[Hit]:
        """The best reusable prefix for `prompt`, or None (counted as a miss)."""
        if not self.enabled or len(prompt) < 2:
            self.misses += 1 if self.enabled else 0
            return None
        tokens = tuple(prompt)
        with self.lock:
            e, reused = self._lookup(namespace, tokens)
            if e is None:
                self.misses += 1
                return None
            self._entries.move_to_end(e.eid)
            self.hits += 1
            self.tokens_reused += reused
            held = e.caches           # pinned: a reference keeps it alive if evicted
        caches = copy.deepcopy(held)
        extra = e.length - reused
        if extra:
            for c in caches:
                c.trim(extra)
        return Hit(caches, reused)

    def _lookup(self, namespace: str, tokens: tuple):
        tree = self._trees.get(namespace)
        if tree is None:
            return None, 0
        before = tree.ops
        m = tree.match(tokens, len(tokens) - 1)
        end_len = m.end.depth if m.end is not None else 0
        if m.trim is not None and m.trim_len > end_len:
            node, reused = tree.trimmable_below(m.trim), m.trim_len
        elif m.end is not None:
            node, reused = m.end, end_len
        else:
            node, reused = None, 0
        self.ops += tree.ops - before
        return (self._entries[node.entry] if node is not None else None), reused

    def store(self, namespace: str, tokens: list, caches: list, copy_caches: bool = True) -> None:
        """Keep (a copy of) `caches`, which hold exactly `tokens`. `copy_caches=False`
        hands them over: the caller must never touch them again."""
        if not self.enabled or not tokens:
            return
        mx.eval(cache_arrays(caches))     # no graph may pin the buffers it was made from
        trimmable = all(c.is_trimmable() for c in caches)
        size = entry_bytes(caches, len(tokens))
        cut = False
        if size > self.max_bytes:
            n = fitting_prefix(caches, len(tokens), self.max_bytes) if trimmable else 0
            if n == 0:
                return
            caches, tokens, cut = [c.head(n) for c in caches], tokens[:n], True
            size = entry_bytes(caches, n)
            if size > self.max_bytes:   # (fitting_prefix rounds its estimate up)
                return
        elif copy_caches:
            caches = copy.deepcopy(caches)
        key = tuple(tokens)
        with self.lock:
            tree = self._trees.get(namespace)
            # An entry that is a prefix of the new one is redundant when the new one can be
            # trimmed back to it; a wrapped sliding-window ring cannot, so keep it then.
            for node in tree.ends_on_path(key) if tree is not None else ():
                if trimmable or node.depth == len(key):
                    self._drop(node.entry)
            tree = self._trees.get(namespace)
            if tree is None:
                tree = self._trees[namespace] = PrefixTree()
            eid = self._next_id
            self._next_id += 1
            node = tree.insert(key)
            tree.set_entry(node, eid, trimmable)
            e = self._entries[eid] = _Entry(eid, namespace, node, list(caches), size, len(key))
            self._bytes += size
            self.array_bytes += e.arrays
            self.cut += cut
            while self._bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def _drop(self, eid: int) -> None:
        e = self._entries.pop(eid)
        self._bytes -= e.size
        self.array_bytes -= e.arrays
        tree = self._trees[e.ns]
        tree.clear_entry(e.node)
        if tree.empty():
            del self._trees[e.ns]

    def clear(self, namespace: Optional[str] = None) -> None:
        with self.lock:
            for eid in [k for k, e in self._entries.items()
                        if namespace is None or e.ns == namespace]:
                self._drop(eid)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "max_bytes": self.max_bytes, "bytes": self._bytes,
                "entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "tokens_reused": self.tokens_reused}
