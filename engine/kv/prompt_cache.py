"""Byte-capped LRU of KV prefixes, shared across calls.

An entry is the per-layer cache after some token sequence was fed, stored
under a namespace (the base model, or one adapter stack: caches computed with
different weights must never mix). A lookup returns a *copy* of the entry
with the longest common prefix with the new prompt, trimmed to that prefix
where the cache type allows, always leaving at least one prompt token to
recompute (the last token's logits are needed to sample).

A cache that cannot be trimmed (a sliding-window ring that has wrapped) is
reused only when its whole token sequence is a prefix of the prompt.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _nbytes(caches) -> int:
    return sum(c.nbytes for c in caches)


@dataclass
class Hit:
    caches: list          # a private copy, positioned after `reused` tokens
    reused: int           # how many prompt tokens are already in the caches


class PromptCache:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = int(max_bytes)
        self._entries: "OrderedDict[tuple, tuple[list, int]]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.tokens_reused = 0

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
        best, best_n = None, 0
        with self._lock:
            for key, (caches, _) in self._entries.items():
                if key[0] != namespace:
                    continue
                tokens = key[1]
                n = min(_common_prefix(tokens, prompt), len(prompt) - 1)
                if n <= best_n:
                    continue
                if n < len(tokens) and not all(c.is_trimmable() for c in caches):
                    continue  # would need trimming a wrapped ring buffer
                best, best_n = key, n
            if best is None:
                self.misses += 1
                return None
            self._entries.move_to_end(best)
            caches = copy.deepcopy(self._entries[best][0])
        extra = len(best[1]) - best_n
        if extra:
            for c in caches:
                c.trim(extra)
        self.hits += 1
        self.tokens_reused += best_n
        return Hit(caches, best_n)

    def store(self, namespace: str, tokens: list, caches: list, copy_caches: bool = True) -> None:
        """Keep (a copy of) `caches`, which hold exactly `tokens`. `copy_caches=False`
        hands them over: the caller must never touch them again."""
        if not self.enabled or not tokens:
            return
        size = _nbytes(caches)
        if size > self.max_bytes:
            return
        key = (namespace, tuple(tokens))
        entry = copy.deepcopy(caches) if copy_caches else list(caches)
        with self._lock:
            # An entry that is a prefix of the new one is redundant when the new one can be
            # trimmed back to it; a wrapped sliding-window ring cannot, so keep it then.
            trimmable = all(c.is_trimmable() for c in caches)
            for k in [k for k in self._entries if k[0] == namespace and
                      (trimmable or len(k[1]) == len(tokens)) and
                      len(k[1]) <= len(tokens) and tuple(tokens[:len(k[1])]) == k[1]]:
                self._bytes -= self._entries.pop(k)[1]
            self._entries[key] = (entry, size)
            self._bytes += size
            while self._bytes > self.max_bytes and self._entries:
                _, (_, sz) = self._entries.popitem(last=False)
                self._bytes -= sz
                self.evictions += 1

    def clear(self, namespace: Optional[str] = None) -> None:
        with self._lock:
            for k in [k for k in self._entries if namespace is None or k[0] == namespace]:
                self._bytes -= self._entries.pop(k)[1]

    def stats(self) -> dict:
        return {"enabled": self.enabled, "max_bytes": self.max_bytes, "bytes": self._bytes,
                "entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "tokens_reused": self.tokens_reused}
