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
row keeps its own processor). A token the matcher cannot take (not possible
when every token comes from the masked logits) puts it in an error state:
``error`` says why, and from then on only the end-of-sequence tokens are
allowed, so the request ends instead of producing text the grammar forbids.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import llguidance
import mlx.core as mx
import numpy as np

__all__ = ["GrammarProcessor", "ll_tokenizer", "compile_grammar"]

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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


class GrammarProcessor:
    """Constrain one generation to a compiled grammar (see module doc)."""

    def __init__(self, grammar: str, tokenizer):
        self.grammar = grammar
        self._lt = ll_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self._lt, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {self.matcher.get_error()}")
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
        if not self.matcher.is_error():
            self.matcher.consume_tokens([int(t) for t in new])

    def allowed(self, vocab: int) -> np.ndarray:
        """Boolean mask [vocab] of the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little").view(bool)  # 0/1
        if bits.size >= vocab:
            return bits[:vocab]
        return np.concatenate([bits, np.zeros(vocab - bits.size, bool)])

    def __call__(self, tokens, logits: mx.array) -> mx.array:
        if self._start is not None:
            # Reading the last sampled token waits for it. Queue this step's
            # forward first, so the mask is computed on the host while it runs.
            mx.async_eval(logits)
        self._advance(tokens)
        mask = mx.array(self.allowed(logits.shape[-1]))
        return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))
