"""The batch runner's request and event types (`engine.step.batch` exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx

__all__ = ["BatchRequest", "RowEvent"]


@dataclass
class BatchRequest:
    """One row. `prompt` is the token ids still to run through the model (after
    any prefix held in `caches`, single-row caches from a prompt cache)."""

    prompt: Sequence[int]
    max_tokens: Optional[int] = 256             # None: the caller ends the row (`retire`)
    sampler: Optional[Callable] = None          # fn(logprobs [n, V], key=None) -> [n]
    seed: Optional[int] = None                  # per-row PRNG key (else the global PRNG)
    logits_processors: Sequence[Callable] = ()  # fn(tokens [T], logits [1, V]) -> logits
    stop_tokens: Optional[Iterable[int]] = None  # default: the scheduler's EOS ids
    stop: Sequence[str] = ()                    # stop strings (needs a tokenizer)
    caches: Optional[list] = None
    history: Sequence[int] = ()                 # tokens already in `caches` (processor context)
    return_cache: bool = False                  # the finishing event carries the row's KV
    lookup: Optional[object] = None             # engine.step.batch_lookup.RowLookup: greedy
                                                # prompt-lookup speculation (L1)
    draft: Optional[object] = None              # engine.step.batch_draft.RowDraft: greedy
                                                # draft-model speculation (L1; the scheduler's
                                                # draft_model)
    embeddings: Optional[mx.array] = None       # [1, len(prompt), D]: the prompt's input
                                                # embeddings (images merged in), fed instead
                                                # of its tokens' own (engine.step.batch_vision)
    positions: Optional[object] = None          # the row's own token positions (the model's
                                                # M-RoPE `Positions` of its whole prompt, a
                                                # reused prefix included; engine.step.batch_vision)
    on_prefilled: Optional[Callable] = None     # fn(single-row caches): once the row's caches
                                                # hold its prompt but the last token
    adapters: tuple = ()                        # runtime adapter ids of this row
                                                # (engine.adapters.rows; the rest: base)
    first_logits: Optional[mx.array] = None     # [1, V]: the caller ran the whole prompt
                                                # (`caches` hold it, `prompt` is its last
                                                # token): the row graduates on these logits


@dataclass
class RowEvent:
    uid: int
    token: Optional[int]                 # None for a cancelled row's last event
    logprobs: Optional[mx.array]         # [V] log-softmax of the step that produced `token`
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled" | "error"
    text: str = ""                       # text made final by this token (tokenizer given)
    stop_token: bool = False             # `token` is an EOS/stop token (not part of the text)
    stop_string: Optional[str] = None    # the stop string that ended the row
    caches: Optional[list] = None        # finishing row's single-row caches (return_cache=True);
                                         # they hold the prompt and every emitted token
    error: Optional[BaseException] = None  # finish_reason "error": what this row raised
