"""Draft-model speculative decoding for a request that runs alone (the exact runner).

A second, smaller model with the target's vocabulary (the *draft*) proposes up to K tokens,
one forward each, sampled with the request's own sampler; the target then runs one forward
over [its last token, the K drafts] and samples every position with one sampler call. The
drafts equal to the target's own choice at their position are handed out, then the target's
choice after the last of them (free: no forward of its own). The rejected drafts' keys and
values are trimmed from both models' caches.

This is mlx-lm's scheme (`mlx_lm.generate.speculative_generate_step`, the oracle of
`tests/parity/test_draft.py`): the same forwards over the same tokens, the same sampler calls
in the same order (K draws of the draft, then one of the target over its K + 1 rows), so
greedy and seeded requests give its tokens and logprobs bit for bit. Sampled, a draft is
kept when the target's own draw equals it: every token handed out is the target's sample
(its distribution is the target's), but fewer drafts are kept than rejection sampling keeps.
`spec_sampling="rejection"` keeps them by the speculative-sampling rule instead
(`engine.step.rejection`): the target's distribution still, not mlx-lm's bits.

`draft_generate_step` yields (token, logprobs [V], from_draft) for up to max_tokens tokens.
Requests with logits processors (penalties, logit bias, grammars) do not speculate
(`SamplingParams.drafts`): mlx-lm's processors there see a history without the prompt, which
after rejected drafts can hold a draft in place of the token handed out (see
docs/oracle-quirks.md): not what they see without speculation.
"""

from __future__ import annotations

from typing import Iterator, Optional

import mlx.core as mx

from engine.kv.quant import KVPolicy
from engine.step.rejection import rejection_rule
from engine.step.speculation import SpecStats
from engine.step.stepper import greedy, prefill


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (vocabulary, caches, settings)."""


def check_draft(model, tokenizer, draft_model, draft_tokenizer=None) -> None:
    """Raise `DraftModelError` unless `draft_model` can draft for `model`: the same
    tokenizer vocabulary (when `draft_tokenizer` is given), no more embedding rows than the
    target's (its tokens must be the target's), and caches on both that can be trimmed back
    (growing full-attention caches: no sliding-window rings, no recurrent state)."""
    from engine.step.request import model_vocab_size

    if draft_tokenizer is not None:
        _check_vocab(tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    rows, target_rows = model_vocab_size(draft_model), model_vocab_size(model)
    if rows and target_rows and rows > target_rows:
        raise DraftModelError(f"the draft model has {rows} token embeddings, more than the "
                              f"target's {target_rows}")
    for name, m in (("target", model), ("draft", draft_model)):
        kinds = {type(c).__name__ for c in m.make_cache()}
        if kinds != {"KVCache"}:
            raise DraftModelError(
                f"the {name} model's caches ({', '.join(sorted(kinds))}) cannot be trimmed "
                "back after a rejected draft; draft-model speculation needs full-attention "
                "layers only")


def _check_vocab(target: dict, draft: dict) -> None:
    if draft == target:
        return
    if len(draft) != len(target):
        why = f"{len(draft)} tokens, the target's {len(target)}"
    else:
        ids = {i: t for t, i in target.items()}
        tok, i = next((t, i) for t, i in sorted(draft.items(), key=lambda x: x[1])
                      if ids.get(i) != t)
        why = f"token {i} is {tok!r} there, {ids.get(i)!r} in the target's"
    raise DraftModelError(f"the draft model's tokenizer vocabulary is not the target's ({why}):"
                          " a draft model must share the target's tokenizer")


def load_draft(path, model, tokenizer):
    """The draft model at `path` (a directory or a Hugging Face repo id), loaded by
    `engine.load` and checked against the target (`check_draft`)."""
    from engine.loader import ModelLoadError, load

    try:
        draft, draft_tok = load(path)
    except (ModelLoadError, FileNotFoundError) as e:
        raise DraftModelError(f"cannot load the draft model: {e}") from None
    check_draft(model, tokenizer, draft, draft_tok)
    return draft


def _propose(draft_model, caches: list, inputs: mx.array, k: int, draw,
             policy: KVPolicy) -> tuple:
    """(k draft tokens, their distributions): a forward over `inputs` (the draft's tokens
    not yet in its caches), then one over each drawn token but the last; `draw(logprobs)`
    gives (token [1], its distribution [1, V] or None)."""
    tokens, dists = [], []
    for _ in range(k):
        logits = draft_model(inputs[None], cache=caches)[:, -1:, :].squeeze(0)    # [1, V]
        policy.apply(caches)
        inputs, q = draw(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.async_eval(inputs)
        tokens.append(inputs)
        dists.append(q)
    return mx.concatenate(tokens), dists


def draft_generate_step(prompt: mx.array, model, draft_model, *, max_tokens: int,
                        caches: list, draft_caches: list, num_draft_tokens: int,
                        sampler=None, draft_prompt: Optional[mx.array] = None,
                        policy: Optional[KVPolicy] = None, prefill_step_size: int = 2048,
                        stats: Optional[SpecStats] = None,
                        spec_sampling: str = "exact") -> Iterator[tuple]:
    """Yield (token, logprobs [V], from_draft) for up to max_tokens tokens.

    `prompt`: the tokens the target's `caches` do not hold yet (all but the last are
    prefilled here, in chunks of `prefill_step_size`, as `stepper.generate_step` does);
    `draft_prompt` (default `prompt`): the same for the draft's `draft_caches` (after a
    prompt-cache hit, the target's caches hold a prefix and the draft's nothing). When the
    caller stops (closes the generator) or max_tokens is reached, the target's caches hold
    every token handed out but the last, and the last too when it was a draft (the verify
    forward computed its keys): never a token not handed out.

    `spec_sampling`: "exact" (mlx-lm's scheme, above) or "rejection" (sampled requests keep
    drafts by the speculative-sampling rule, `engine.step.rejection`; greedy is the same)."""
    if prompt.size == 0:
        raise ValueError("the prompt is empty")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
    policy = policy or KVPolicy()
    sampler = sampler or greedy
    rule = rejection_rule(sampler, spec_sampling)
    draw = rule.draw if rule is not None else (lambda lp: (sampler(lp), None))
    stats = stats if stats is not None else SpecStats()
    draft_inputs = prefill(draft_model, prompt if draft_prompt is None else draft_prompt,
                           draft_caches, KVPolicy(), prefill_step_size)
    last = prefill(model, prompt, caches, policy, prefill_step_size)
    handed = 0
    while handed < max_tokens:
        k = min(num_draft_tokens, max_tokens - handed)
        draft, dists = _propose(draft_model, draft_caches, draft_inputs, k, draw, KVPolicy())
        logits = model(mx.concatenate([last, draft])[None], cache=caches)[0]   # [k + 1, V]
        policy.apply(caches)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if rule is not None:         # chosen[:ok]: the accepted drafts; then the residual draw
            chosen, ok = rule.verify(logprobs, draft, dists)
            proposed = draft.tolist()
        else:
            chosen = sampler(logprobs)
            mx.eval(chosen, draft)
            chosen, proposed = chosen.tolist(), draft.tolist()
            ok = 0                   # drafts equal to the target's choice before a mismatch
            while ok < k and chosen[ok] == proposed[ok]:
                ok += 1
        stats.record(k, 0)
        kept = 0                     # of them, handed out (their keys stay in the caches)
        try:
            for i in range(ok + 1):
                kept = min(i + 1, ok)
                handed += 1
                if i < ok:
                    stats.record(0, 1, forwards=0)
                yield chosen[i], logprobs[i], i < ok
                if handed == max_tokens:
                    break
        finally:
            # the target's caches hold [last, drafts...]: the drafts not handed out leave;
            # the draft's hold [its inputs, drafts but the last...]: the same drafts leave
            if k > kept:
                for c in caches:
                    c.trim(k - kept)
            if k - kept > 1:
                for c in draft_caches:
                    c.trim(k - kept - 1)
        last = mx.array([chosen[ok]])
        # every draft kept: the last one is not in the draft's caches yet
        draft_inputs = last if ok < k else mx.array([proposed[-1], chosen[ok]])
