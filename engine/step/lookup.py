"""Prompt-lookup speculative decoding for a request that runs alone (the exact runner).

No second model: at each step the draft is the tokens that followed the latest earlier
occurrence of the last `ngram` tokens of the request's own prompt and output, repeated on where
they run into the newest tokens (`NgramIndex.propose`, up to `draft_tokens`); one forward over [last token, draft...] verifies
them all. Greedy only: the accepted drafts are the ones equal to the argmax of the logits
before them, then the argmax after the last accepted one comes free. The rejected drafts'
keys and values are trimmed from the caches, so the caches hold exactly what
`stepper.generate_step` would hold after the same tokens.

`lookup_generate_step` yields (token, logprobs [V]) like `stepper.generate_step` and takes the
same prefill (the prompt minus its last token, in the same chunks). Where a forward over several
tokens gives each position the logits single steps give (the CPU: checked by
`tests/engine/test_prompt_lookup.py`), its tokens and logprobs equal `generate_step`'s bit for
bit, with fewer forwards on text that repeats its context (code being edited, quotes).
"""

from __future__ import annotations

from typing import Iterator, Optional

import mlx.core as mx

from engine.kv.quant import KVPolicy
from engine.step.speculation import SpecStats
from engine.step.stepper import prefill


class NgramIndex:
    """The latest start of every `n`-gram of a growing token list, but the last one."""

    def __init__(self, tokens: list, n: int):
        self.n, self.tokens, self.last = n, [], {}
        for t in tokens:
            self.append(t)

    def append(self, t: int) -> None:
        self.tokens.append(int(t))
        i = len(self.tokens) - self.n - 1     # the n-gram before the newest one, now indexed
        if i >= 0:
            self.last[tuple(self.tokens[i:i + self.n])] = i

    def propose(self, k: int) -> list:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens.
        Where that continuation runs into the newest tokens (the text since the occurrence
        repeats itself: a run of one token, a repeated line), it goes on repeating with the
        same period, as copying on from the occurrence would: k tokens, not the few left."""
        if k <= 0 or len(self.tokens) <= self.n:
            return []
        i = self.last.get(tuple(self.tokens[-self.n:]))
        if i is None:
            return []
        out = self.tokens[i + self.n:i + self.n + k]
        period = len(self.tokens) - self.n - i
        while len(out) < k:
            out.append(out[len(out) - period])
        return out


def lookup_unsupported(model):
    """Why prompt lookup cannot run on this model (None where it can): a rejected draft is
    trimmed back from the caches, which only growing full-attention caches (`KVCache`) allow.
    A sliding-window ring verifying several tokens in one forward does not give the logits of
    single steps (its window is read in another order), so greedy output would change."""
    kinds = {type(c).__name__ for c in model.make_cache()}
    if kinds == {"KVCache"}:
        return None
    return (f"this model's caches ({', '.join(sorted(kinds))}) cannot take prompt lookup; it "
            "needs full-attention layers only (or deterministic mode, whose windows are kept in order)")


def lookup_generate_step(prompt: mx.array, model, *, max_tokens: int, caches: list,
                         ngram: int, draft_tokens: int, context: list,
                         policy: Optional[KVPolicy] = None, prefill_step_size: int = 2048,
                         stats: Optional[SpecStats] = None) -> Iterator[tuple]:
    """Yield (token, logprobs [V]) for up to max_tokens greedy tokens. `context`: every token
    before the new ones (a cached prefix and the prompt), where drafts are looked up."""
    if prompt.size == 0:
        raise ValueError("the prompt is empty")
    policy = policy or KVPolicy()
    stats = stats if stats is not None else SpecStats()
    index = NgramIndex(list(context), ngram)
    y = int(prefill(model, prompt, caches, policy, prefill_step_size).item())
    n = 0
    while n < max_tokens:
        draft = index.propose(min(draft_tokens, max_tokens - n - 1))
        logits = model(mx.array([[y] + draft]), cache=caches)[0]
        policy.apply(caches)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        toks = mx.argmax(logprobs, axis=-1).tolist()
        ok = 0
        while ok < len(draft) and toks[ok] == draft[ok]:
            ok += 1
        stats.record(len(draft), ok)
        if ok < len(draft):                   # the rejected drafts leave the caches
            for c in caches:
                c.trim(len(draft) - ok)
        held = ok        # accepted drafts whose keys are in the caches and not yet handed out
        try:
            for i in range(ok + 1):
                index.append(toks[i])
                held = ok - i
                yield toks[i], logprobs[i]
                n += 1
                if n >= max_tokens:
                    return
        except GeneratorExit:                 # the caller stopped (EOS, a stop string...): the
            if held > 1:                      # caches keep the tokens handed out, as
                for c in caches:              # generate_step's would
                    c.trim(held - 1)
            raise
        y = toks[ok]
