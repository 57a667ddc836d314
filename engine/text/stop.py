"""Stop-string matching on streamed, decoded text.

``StopMatcher(stops)`` is fed the text deltas of a generation (for example the
``last_segment`` of a streaming detokenizer) and returns what may be shown:

    m = StopMatcher(["\\nUser:", "###"])
    for delta in deltas:
        emit, stopped = m.feed(delta)
        send(emit)
        if stopped:
            break
    else:
        send(m.flush())          # generation ended for another reason

Guarantees, for any way the same text is cut into deltas:

- the concatenated output is ``text[:i]`` where ``i`` is the earliest start of
  any stop string in ``text`` (all of ``text`` if none occurs), so the stop
  string and everything after it are never shown;
- text that could still turn out to be the start of a stop string is held back,
  so nothing emitted is ever retracted;
- ``stopped`` becomes true as soon as the earliest match is certain: a match
  that completes while an earlier-starting one is still possible waits until
  that one is settled. ``flush()`` settles everything at the end of the stream.

``stop_string`` is the stop string that matched (the first in ``stops`` order
among those that start at the cut), ``None`` if none did.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["StopMatcher", "TextStream", "cut_at_stop"]


def cut_at_stop(text: str, stops: Iterable[str]) -> tuple[str, str | None]:
    """The whole-text reference: ``text`` cut at the earliest stop occurrence."""
    best, which = len(text), None
    for s in stops:
        if not s:
            continue
        i = text.find(s, 0, best + len(s))
        if i != -1 and i < best:
            best, which = i, s
    return text[:best], which


class StopMatcher:
    __slots__ = ("stops", "_buf", "_firsts", "stopped", "stop_string", "max_len")

    def __init__(self, stops: Iterable[str] | None) -> None:
        seen: list[str] = []
        for s in stops or ():
            if s and s not in seen:  # empty stop strings never match
                seen.append(s)
        self.stops: tuple[str, ...] = tuple(seen)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._firsts = tuple((s[0], s) for s in self.stops)
        self._buf = ""
        self.stopped = False
        self.stop_string: str | None = None

    def reset(self) -> None:
        self._buf = ""
        self.stopped = False
        self.stop_string = None

    @property
    def pending(self) -> str:
        """Text received but held back (it may be the start of a stop string)."""
        return self._buf

    def _earliest_match(self, buf: str) -> tuple[int, str | None]:
        best, which = -1, None
        for s in self.stops:
            end = len(buf) if best < 0 else best + len(s)
            i = buf.find(s, 0, end)
            if i != -1 and (best < 0 or i < best):
                best, which = i, s
        return best, which

    def _earliest_partial(self, buf: str, limit: int) -> int:
        """Earliest q < limit such that buf[q:] is a proper prefix of a stop string."""
        n = len(buf)
        best = limit
        for first, s in self._firsts:
            lo = n - len(s) + 1
            if lo < 0:
                lo = 0
            q = buf.find(first, lo, best)
            while q != -1:
                if s.startswith(buf[q:]):
                    best = q
                    break
                q = buf.find(first, q + 1, best)
        return best

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next piece of text; return (text safe to emit, stopped)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._buf + delta if self._buf else delta
        if not buf:
            return "", False
        m, which = self._earliest_match(buf)
        limit = m if m >= 0 else len(buf)
        p = self._earliest_partial(buf, limit)
        if m >= 0 and p >= m:
            self._buf = ""
            self.stopped = True
            self.stop_string = which
            return buf[:m], True
        self._buf = buf[p:]
        return buf[:p], False

    def flush(self) -> str:
        """End of stream: return the held-back text that is not part of a stop."""
        if self.stopped:
            return ""
        buf, self._buf = self._buf, ""
        m, which = self._earliest_match(buf)
        if m >= 0:
            self.stopped = True
            self.stop_string = which
            return buf[:m]
        return buf


class TextStream:
    """One request's text: a streaming detokenizer (never splits a character; drops
    one space at the very start, like mlx-lm's streamed text) and its stop strings.

    `feed(token, finishing)` takes the next token (None: a stop/EOS token, which is
    not part of the text) and returns (text made final by it, a stop string hit);
    when `finishing`, the held-back text is flushed too."""

    __slots__ = ("detok", "matcher")

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.detok = tokenizer.make_detokenizer(trim_leading_space=True)
        stop = list(stop or ())
        self.matcher = StopMatcher(stop) if stop else None

    @property
    def stop_string(self) -> str | None:
        return self.matcher.stop_string if self.matcher is not None else None

    def feed(self, token: int | None, finishing: bool) -> tuple[str, bool]:
        text, hit = "", False
        if token is not None:
            self.detok.add_token(token)
            text = self.detok.last_segment
            if self.matcher is not None:
                text, hit = self.matcher.feed(text)
        if hit or not finishing:
            return text, hit
        self.detok.finalize()
        tail = self.detok.last_segment
        if self.matcher is not None:
            tail, hit = self.matcher.feed(tail)
            if not hit:
                tail += self.matcher.flush()
        return text + tail, hit
