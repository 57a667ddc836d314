"""The grammar logits processor: llguidance's token mask applied to the logits.

A ``GrammarProcessor`` is a logits processor of the usual shape
``fn(tokens, logits [1, V]) -> logits`` (see ``engine.step.sampling``), one per
request, stateful: the first call sees the prompt (``tokens`` is the history
the loop hands processors); each later call finds exactly the tokens sampled
since, advances the grammar matcher by them (reading them on the host), then
sets every token the grammar does not allow next to ``-inf``. Before it waits
for the last token it queues the step's forward (``mx.async_eval``), so the
mask is computed on the host while the model runs, not after it. When the
grammar is complete only the end-of-sequence tokens remain allowed, so the
loop stops with ``finish_reason == "stop"``.

It works in the serial loop and per row in ``BatchScheduler`` alike (each
row keeps its own processor). A grammar that dead-ends (llguidance gives up
on it mid-way: its Earley rows or lexer overflow a limit, or the only way on
is text no token spells) raises ``GrammarDeadEnd`` from the processor, so
the request ends with ``finish_reason "error"`` instead of an unfinished
output that looks like success.

Compiling is the expensive part (the lexer and parser tables of the
tokenizer's vocabulary): ``compile_matcher`` builds a checked matcher once per
grammar and tokenizer (a bounded LRU, ``GRAMMAR_CACHE_SIZE`` entries per
tokenizer) and each request's processor starts from a copy of it.
``compile_matcher`` also probes the first ``PROBE_STEPS`` tokens, so a grammar
that dead-ends at once (``{"$ref": "#"}``) is refused before generation.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from typing import Optional, Sequence

import llguidance
import mlx.core as mx
import numpy as np

__all__ = ["GrammarProcessor", "GrammarDeadEnd", "ll_tokenizer", "compile_grammar",
           "compile_matcher", "parser_limits", "GRAMMAR_CACHE_SIZE", "PROBE_STEPS"]

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MATCHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> LRU
_LOCK = threading.Lock()
GRAMMAR_CACHE_SIZE = 64
PROBE_STEPS = 8
ERROR_CHARS = 300


class GrammarDeadEnd(ValueError):
    """The grammar allows no way on: the output cannot be finished."""


def parser_limits() -> "llguidance.LLParserLimits":
    """llguidance's limits (its defaults: at most 2000 Earley items in a row,
    1,000,000 units of lexer fuel to build the lexer, 500,000 grammar symbols),
    with short error messages (no parser state dump)."""
    return llguidance.LLParserLimits(verbose_errors=False)


def _short(err: str) -> str:
    """llguidance's message without its state dump and marker, for a client to read."""
    err = err.split("\n<state>", 1)[0].replace("<non-verbose/>", "")
    for prefix in ("Parser Error: ", "parser error: "):
        err = err.replace(prefix, "")
    if err.strip() == "NoExtensionBias":
        err = "the schema allows no value to start (a $ref to itself, or a $ref loop?)"
    if "items; max is" in err:
        err = "the schema is too large for the grammar (too many optional properties?): " + err
    return err.strip()[:ERROR_CHARS]


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of an ``engine.text.tokenizer.Tokenizer`` (built from its
    ``tokenizers`` JSON; the EOS tokens are the tokenizer's stop tokens),
    cached per tokenizer object."""
    lt = _TOKENIZERS.get(tokenizer)
    if lt is None:
        lt = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                    eos_token=sorted(tokenizer.eos_token_ids))
        _TOKENIZERS[tokenizer] = lt
    return lt


def compile_grammar(lark: str, tokenizer) -> str:
    """llguidance's grammar for a Lark text (checked when a ``GrammarProcessor``
    is made from it: ValueError naming the problem if it is not usable)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _mask(matcher, words: np.ndarray, vocab: int) -> np.ndarray:
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").view(bool)
    if bits.size >= vocab:
        return bits[:vocab]
    return np.concatenate([bits, np.zeros(vocab - bits.size, bool)])


def dead_end(matcher, allowed: np.ndarray, eos: Sequence[int]) -> Optional[str]:
    """Why the grammar cannot go on from here (None when it can): llguidance's
    error, or no token allowed but end-of-sequence while the output is unfinished."""
    if matcher.is_stopped() and not matcher.is_error():
        return None
    if matcher.is_error():
        return _short(matcher.get_error())
    if matcher.is_accepting():
        return None
    rest = allowed.copy()
    rest[[t for t in eos if t < rest.size]] = False
    if not rest.any():
        return "no token can continue the output, which is not finished"
    return None


def _probe(matcher, lt, eos: Sequence[int]) -> None:
    """Walk the first PROBE_STEPS tokens (the lowest allowed id each time) on a copy."""
    m = matcher.deep_copy()
    words = np.zeros((lt.vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(PROBE_STEPS):
        allowed = _mask(m, words, lt.vocab_size)
        why = dead_end(m, allowed, eos)
        if why is not None:
            raise ValueError(f"the grammar cannot be completed: {why}")
        allowed[[t for t in eos if t < allowed.size]] = False
        ids = np.flatnonzero(allowed)
        if ids.size == 0:
            return            # finished
        m.consume_token(int(ids[0]))


def compile_matcher(lark: str, tokenizer):
    """A checked, probed llguidance matcher for ``lark`` (shared: copy it per
    request); cached per tokenizer. ValueError naming the problem when unusable."""
    key = hashlib.sha256(lark.encode("utf-8", "surrogatepass")).digest()
    with _LOCK:
        lru = _MATCHERS.setdefault(tokenizer, OrderedDict())
        hit = lru.get(key)
        if hit is not None:
            lru.move_to_end(key)
            return hit
    lt = ll_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(lt, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise ValueError(f"the grammar cannot be used: {_short(matcher.get_error())}")
    _probe(matcher, lt, sorted(tokenizer.eos_token_ids))
    with _LOCK:
        lru[key] = matcher
        while len(lru) > GRAMMAR_CACHE_SIZE:
            lru.popitem(last=False)
    return matcher


class GrammarProcessor:
    """Constrain one generation to a compiled grammar (see module doc)."""

    def __init__(self, grammar, tokenizer):
        """``grammar``: a matcher from ``compile_matcher`` (copied) or a grammar text."""
        self._lt = ll_tokenizer(tokenizer)
        self._eos = sorted(tokenizer.eos_token_ids)
        if isinstance(grammar, str):
            self.grammar = grammar
            self.matcher = llguidance.LLMatcher(self._lt, grammar, log_level=0,
                                                limits=parser_limits())
            if self.matcher.is_error():
                raise ValueError(f"the grammar cannot be used: "
                                 f"{_short(self.matcher.get_error())}")
        else:
            self.grammar = grammar
            self.matcher = grammar.deep_copy()
        self._words = np.zeros((self._lt.vocab_size + 31) // 32, dtype=np.int32)
        self._start: Optional[int] = None
        self._consumed = 0

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def complete(self) -> bool:
        """The output so far is a whole match (an end-of-sequence token is allowed next)."""
        return self.matcher.is_accepting()

    def _advance(self, tokens) -> None:
        n = tokens.size if isinstance(tokens, mx.array) else len(tokens)
        if self._start is None:
            self._start = n
            return
        k = n - self._start - self._consumed
        if k <= 0:
            return
        new: Sequence[int] = (tokens[n - k:].tolist() if isinstance(tokens, mx.array)
                              else list(tokens[n - k:]))
        self._consumed += k
        # (a lane that computes the step after the end-of-sequence token ahead of
        # time hands over tokens past the end: a stopped matcher ignores them)
        if not self.matcher.is_error() and not self.matcher.is_stopped():
            self.matcher.consume_tokens([int(t) for t in new])

    def masks_ahead(self, drafts: Sequence[int], vocab: int) -> list:
        """The allowed-token masks [vocab] after drafts[:1], drafts[:2], ... from the state
        after the last token this processor saw (a speculating row's verify positions 1, 2,
        ...), as far as the grammar takes the drafts: a draft it does not allow, one that ends
        it, or a position allowing nothing ends the list. The matcher is rolled back after."""
        m = self.matcher
        if m.is_error() or m.is_stopped() or not drafts:
            return []
        drafts = [int(t) for t in drafts]
        masks, fed = [], 0
        for t in drafts[:m.validate_tokens(drafts)]:
            if not m.consume_tokens([t]):
                break
            fed += 1
            if m.is_stopped() or m.is_error():
                break
            allowed = self.allowed(vocab)
            if dead_end(m, allowed, self._eos) is not None:
                break
            masks.append(allowed)
        if fed:
            m.rollback(fed)
        return masks

    def allowed(self, vocab: int) -> np.ndarray:
        """Boolean mask [vocab] of the tokens the grammar allows next."""
        return _mask(self.matcher, self._words, vocab)

    def __call__(self, tokens, logits: mx.array) -> mx.array:
        if self._start is not None:
            # Reading the last sampled token waits for it. Queue this step's
            # forward first, so the mask is computed on the host while it runs.
            mx.async_eval(logits)
        self._advance(tokens)
        allowed = self.allowed(logits.shape[-1])
        why = dead_end(self.matcher, allowed, self._eos)
        if why is not None:
            raise GrammarDeadEnd(f"the output cannot follow the grammar any further: {why}")
        mask = mx.array(allowed)
        return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))
