"""The Engine's context limits: a prompt that leaves no room in the model's context is refused
before anything runs, and `max_tokens` is capped at the context the prompt leaves."""

from __future__ import annotations

from typing import Optional

from engine.step.request import ContextLengthExceeded, SamplingParams


class ContextLimits:
    """Mixed into `engine.step.core.Engine` (its max_context and max_kv_size)."""

    def check_context(self, prompt_tokens: int) -> None:
        """Raise `ContextLengthExceeded` when a prompt this long leaves no room for one
        generated token in the model's context. Any thread."""
        limit = self.max_context
        if limit is not None and prompt_tokens + 1 > limit:
            raise ContextLengthExceeded(prompt_tokens, limit)

    def context_left(self, prompt_tokens: int) -> Optional[int]:
        """Tokens the model's context holds after a prompt this long (None: no limit)."""
        return None if self.max_context is None else self.max_context - prompt_tokens

    def capped(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """`params` with `max_tokens` at most the context left after the prompt
        (a generation cannot run past the model's context; with `max_kv_size` the
        bounded ring may, as mlx-lm's does). Any thread."""
        left = self.context_left(prompt_tokens)
        if left is None or self.max_kv_size or params.max_tokens <= left:
            return params
        from dataclasses import replace
        return replace(params, max_tokens=max(left, 1))
