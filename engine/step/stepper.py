"""The token loop: prefill, then one token at a time.

The schedule is the one mlx-lm's `generate_step` uses, because L1 parity of
logits depends on it: the prompt minus its last token is prefilled in chunks
of `prefill_step_size`, the KV policy runs after each chunk, then the last
prompt token is the first decode step. Each decode step's forward for token
n+1 is queued (`mx.async_eval`) before token n is handed out, so the CPU
bookkeeping of the caller overlaps the next forward.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import mlx.core as mx

from engine.kv.quant import KVPolicy

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def prefill(model, prompt: mx.array, caches: list, policy: Optional[KVPolicy] = None,
            step_size: int = 2048, on_chunk: Optional[Callable[[int], None]] = None,
            embeddings: Optional[mx.array] = None) -> mx.array:
    """Run all of `prompt` but its last token through the model; returns that last token.
    `embeddings` [1, len(prompt), D]: the prompt's input embeddings (images merged in),
    fed instead of the tokens' own."""
    policy = policy or KVPolicy()
    done = 0
    while prompt.size - done > 1:
        done = prefill_chunk(model, prompt, done, caches, policy, step_size, on_chunk,
                             embeddings)
    return prompt[done:]


def prefill_chunk(model, prompt: mx.array, done: int, caches: list, policy: KVPolicy,
                  step_size: int, on_chunk: Optional[Callable[[int], None]] = None,
                  embeddings: Optional[mx.array] = None) -> int:
    """One chunk of `prefill`: up to `step_size` of the prompt's tokens from `done` on
    (never its last token) into the caches; returns the new `done`."""
    n = min(step_size, prompt.size - done - 1)
    if n <= 0:
        return done
    if embeddings is not None:
        model(prompt[done:done + n][None], cache=caches,
              input_embeddings=embeddings[:, done:done + n])
    else:
        model(prompt[done:done + n][None], cache=caches)
    policy.apply(caches)
    mx.eval([c.state for c in caches])
    done += n
    if on_chunk:
        on_chunk(done)
    mx.clear_cache()
    return done


def generate_step(
    prompt: mx.array,
    model,
    *,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[list] = None,
    caches: Optional[list] = None,
    policy: Optional[KVPolicy] = None,
    prefill_step_size: int = 2048,
    history: Optional[mx.array] = None,
    on_prefilled: Optional[Callable[[list], None]] = None,
    decoder: Optional[Callable] = None,
    embeddings: Optional[mx.array] = None,
    whole: bool = False,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs [V]) for up to max_tokens tokens.

    `history` (token ids the processors should see before `prompt`, e.g. the
    cached prefix) matters only with logits processors. `on_prefilled(caches)`
    is called once the caches hold every prompt token but the last (evaluated,
    before the first decode step) — the prompt cache snapshots there; it must
    not modify the caches. `decoder(tokens, caches) -> logits [1, V]` (L3, see
    engine.fast.decode) replaces the model's forward for decode steps only. `embeddings`
    [1, len(prompt), D]: the prompt's input embeddings (images merged in: the prefill and
    the last prompt token's step take them, as mlx-vlm's generate_step does). `whole` (with
    `embeddings`): no prefill, the whole prompt is the first step's forward (as mlx-vlm runs
    a prompt whose images the decoder attends to both ways); `on_prefilled` is not called."""
    if prompt.size == 0:
        raise ValueError("the prompt is empty")
    caches = caches if caches is not None else model.make_cache()
    policy = policy or KVPolicy()
    sampler = sampler or greedy
    seen = history if logits_processors else None

    def step(tokens, embedded=None):
        nonlocal seen
        if embedded is not None:
            logits = model(tokens[None], cache=caches, input_embeddings=embedded)[:, -1, :]
        elif decoder is not None:        # L3 fast decode (engine.fast); prefill stays L1
            logits = decoder(tokens, caches)
        else:
            logits = model(tokens[None], cache=caches)[:, -1, :]
        if logits_processors:
            seen = mx.concatenate([seen, tokens]) if seen is not None else tokens
            for proc in logits_processors:
                logits = proc(seen, logits)
        policy.apply(caches)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return sampler(logprobs), logprobs.squeeze(0)

    if logits_processors and not (whole and embeddings is not None):
        # processors see the whole prompt; all but its last token now
        head = prompt[:-1]
        seen = mx.concatenate([seen, head]) if seen is not None else head
        if seen.size == 0:
            seen = None
    if whole and embeddings is not None:
        y, logprobs = step(prompt, embeddings)
    else:
        last = prefill(model, prompt, caches, policy, prefill_step_size, embeddings=embeddings)
        if on_prefilled is not None and prompt.size > 1:
            on_prefilled(caches)
        if decoder is not None:         # L3: the preallocated buffer (it grows as needed)
            decoder.reserve(caches, 1)
        y, logprobs = step(last, None if embeddings is None else embeddings[:, -1:])
    mx.async_eval(y, logprobs)
    n = 0
    while True:
        if n != max_tokens:
            next_y, next_lp = step(y)
            mx.async_eval(next_y, next_lp)
        if n == 0:
            mx.eval(y)
        if n == max_tokens:
            break
        yield y.item(), logprobs
        if n % 256 == 0:
            mx.clear_cache()
        y, logprobs = next_y, next_lp
        n += 1
