"""Encoding a conversation that grew: the ids of the text already encoded are reused.

An agent sends its whole conversation every turn; rendered by the chat template it is the
previous turn's text plus a few hundred new tokens' worth. `PrefixEncoder.encode(text)` keeps
the last few texts it encoded with their ids and, for a text that starts like one of them,
encodes only the part after the last *cut* they share, reusing the ids before it.

Exactness: the ids are those of encoding the whole text, because a cut is made only right
before an occurrence of a special added token that the Hugging Face tokenizer extracts from
the raw text before anything else (`normalized`, `lstrip`, `rstrip` and `single_word` all
false; special tokens not split). The tokenizer then normalizes, pre-tokenizes and models each
piece between such tokens on its own, so the ids of `text[:p] + text[p:]` are the ids of the
pieces before `p` followed by those from `p` on. The cut's token must also be matched at the
same place in the new text: the two texts share at least the longest added token's length
past `p`, so every added-token match starting at or before `p` is decided by characters both
texts hold. A tokenizer that splits special tokens (`split_special_tokens`) or has no
eligible token is never cut (every text encoded whole). The parity of every fixture
tokenizer is checked by `tests/engine/test_prefix_encode.py` against whole encodes.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict

KEEP = 8               # texts remembered (conversations served at once, roughly)
MIN_TEXT = 2048        # shorter texts are encoded whole (nothing to win)


class _Seen:
    __slots__ = ("text", "ids", "cut_pos", "cut_idx")

    def __init__(self, text: str, ids, cut_pos: list, cut_idx: list):
        self.text = text
        self.ids = array("l", ids)
        self.cut_pos = cut_pos       # char positions where a cut may be made, ascending
        self.cut_idx = cut_idx       # the index of the token that starts there


class PrefixEncoder:
    """`encode(text)`: the ids of `backend.encode(text, add_special_tokens=False)`."""

    def __init__(self, backend, min_text: int = MIN_TEXT):
        self.backend = backend
        self.min_text = min_text
        added = backend.get_added_tokens_decoder()
        self.longest = max((len(t.content) for t in added.values()), default=0)
        self.cut_ids = frozenset(
            i for i, t in added.items()
            if t.special and not (t.normalized or t.lstrip or t.rstrip or t.single_word))
        self._seen: "OrderedDict[int, _Seen]" = OrderedDict()
        self._n = 0
        self._lock = threading.Lock()
        self.reused = 0            # tokens taken from an earlier text (a counter for tests)

    @property
    def enabled(self) -> bool:
        return bool(self.cut_ids) and not getattr(self.backend, "encode_special_tokens", False)

    def encode(self, text: str) -> list:
        if not self.enabled or len(text) < self.min_text:
            return self.backend.encode(text, add_special_tokens=False).ids
        with self._lock:
            seen = list(self._seen.items())
        best, best_key, best_i = None, None, -1
        for key, s in seen:
            i = self._shared_cut(s, text)
            if i >= 0 and (best is None or s.cut_pos[i] > best.cut_pos[best_i]):
                best, best_key, best_i = s, key, i
        if best is None:
            enc = self.backend.encode(text, add_special_tokens=False)
            ids = enc.ids
            pos, idx = self._cuts(enc, ids, text, 0, 0)
        else:
            p, j = best.cut_pos[best_i], best.cut_idx[best_i]
            enc = self.backend.encode(text[p:], add_special_tokens=False)
            tail = enc.ids
            ids = best.ids[:j].tolist() + tail
            pos, idx = self._cuts(enc, tail, text, p, j)
            pos = best.cut_pos[:best_i] + pos       # (the tail's first cut is p itself)
            idx = best.cut_idx[:best_i] + idx
            self.reused += j
        entry = _Seen(text, ids, pos, idx)
        with self._lock:
            if best_key is not None and best_key in self._seen and text.startswith(best.text):
                del self._seen[best_key]      # (the new text continues it: one entry)
            self._n += 1
            self._seen[self._n] = entry
            while len(self._seen) > KEEP:
                self._seen.popitem(last=False)
        return ids

    def _cuts(self, enc, ids, text: str, base: int, first: int):
        """The cut points of an encoding of text[base:] whose first token has index `first`
        in the whole text's ids."""
        pos, idx = [], []
        cut_ids = self.cut_ids
        for j, t in enumerate(ids):
            if t in cut_ids:
                span = enc.token_to_chars(j)
                if span is None:
                    continue
                p = base + span[0]
                if text.startswith(self.backend.id_to_token(t), p):
                    pos.append(p)
                    idx.append(first + j)
        return pos, idx

    def _shared_cut(self, s: _Seen, text: str) -> int:
        """The index of the last cut of `s` that `text` shares (-1: none): `text` and `s.text`
        agree on their first `cut + longest` characters."""
        need = self.longest
        hi = bisect_right(s.cut_pos, min(len(text), len(s.text)) - need) - 1
        if hi < 0 or text[:64] != s.text[:64]:
            return -1
        lo, found = 0, -1
        while lo <= hi:                 # (agreement on a prefix is monotone: bisect)
            mid = (lo + hi) // 2
            n = s.cut_pos[mid] + need
            if text[:n] == s.text[:n]:
                found, lo = mid, mid + 1
            else:
                hi = mid - 1
        return found
