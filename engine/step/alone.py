"""The exact runner's side of `engine.step.core.Engine`: a request that runs alone (max_batch 1
at L1, adapters, prefix caches, quantized KV, a bounded ring) through
`engine.step.stepper.generate_step`, mlx-lm's token loop: its prompt one chunk per step, then
one token per step (on `engine.fast`'s step with a fast lever), each through the Engine's one
update (`_token`)."""

from __future__ import annotations

import time

import mlx.core as mx

from engine.step.draft import DraftModelError, check_draft, draft_generate_step
from engine.step.request import RequestState
from engine.step.lookup import lookup_generate_step
from engine.step.stepper import generate_step, prefill_chunk


class AloneRunner:
    """Mixed into `engine.step.core.Engine` (its model, levers, policy, adapters, caches,
    draft model and speculation counters)."""

    def _set_draft(self, draft_model, draft_tokenizer=None) -> None:
        """The engine's draft model (None: no draft-model speculation), checked against the
        model (`engine.step.draft.check_draft`) and the engine's settings."""
        self.draft_model = draft_model
        if draft_model is None:
            return
        check_draft(self.model, self.tokenizer, draft_model, draft_tokenizer)
        if self.policy.active or self.max_kv_size:
            raise DraftModelError("a draft model needs unquantized, unbounded KV caches (no "
                                  "kv_bits / kv_config, no max_kv_size)")

    def _start_solo(self, req: RequestState) -> None:
        if self.adapters is not None:
            self.adapters.activate(req.adapters)
        p = req.params
        sampler = self._sampler(p)
        processors = p.make_processors()
        if p.seed is not None:
            mx.random.seed(p.seed)
        caches = self._fetch(req)
        if caches is not None:
            self.policy.apply(caches)
        else:
            caches = self._new_caches()
        if self.deterministic:    # (engine.deterministic: sliding windows oldest first)
            from engine.kv.cache import temporal_caches
            temporal_caches(caches)
        reused, ids = req.reused, req.ids
        # The prompt (all but its last token) is prefilled one chunk per step()
        # (`_solo_prefill`, the chunks of `generate_step`'s own prefill); the token loop
        # then starts from the last prompt token, its processors seeing the whole prompt.
        history = mx.array(ids[:-1]) if processors and len(ids) > 1 else None
        req.caches, req.prompt, req.done = caches, mx.array(ids[reused:]), 0
        req.embeds = self.prompt_embeddings(req)     # images merged in (None: no images)
        from engine.fast.apply import decoder_for   # L3: None unless a fast lever is on
        decoder = decoder_for(self.model, self.levers, caches, self.policy)

        def start_decode():
            if req.embeds is not None:   # (images: mlx-vlm's token loop, on the embeddings)
                return generate_step(req.prompt[req.done:], self.model, max_tokens=p.max_tokens,
                                     sampler=sampler, logits_processors=processors or None,
                                     caches=caches, policy=self.policy,
                                     prefill_step_size=self.prefill_step_size, history=history,
                                     embeddings=req.embeds[:, req.done:], whole=req.whole)
            if p.looks_up():        # prompt-lookup speculation (greedy: no sampler needed)
                req.spec = self.spec.for_request("lookup")
                return lookup_generate_step(
                    req.prompt[req.done:], self.model, max_tokens=p.max_tokens, caches=caches,
                    ngram=p.prompt_lookup, draft_tokens=p.num_draft_tokens, context=req.ids,
                    policy=self.policy, prefill_step_size=self.prefill_step_size,
                    stats=req.spec)
            if self.draft_model is not None and p.drafts():   # the draft sees the whole prompt
                req.spec = self.spec.for_request("draft")
                return draft_generate_step(
                    req.prompt[req.done:], self.model, self.draft_model,
                    max_tokens=p.max_tokens, caches=caches,
                    draft_caches=self.draft_model.make_cache(),
                    num_draft_tokens=p.num_draft_tokens, sampler=sampler,
                    draft_prompt=mx.array(req.ids), policy=self.policy,
                    prefill_step_size=self.prefill_step_size, stats=req.spec,
                    spec_sampling=p.spec_sampling)
            return generate_step(req.prompt[req.done:], self.model, max_tokens=p.max_tokens,
                                 sampler=sampler, logits_processors=processors or None,
                                 caches=caches, policy=self.policy,
                                 prefill_step_size=self.prefill_step_size, history=history,
                                 decoder=decoder)
        req.start_decode = start_decode
        req.tic = time.perf_counter()
        self._solo = req

    def _new_caches(self) -> list:
        """The model's caches; with `max_kv_size`, mlx-lm's bounded ones (a ring of that
        many tokens keeping the first 4) where the model has only full-attention layers."""
        from engine.kv.cache import KVCache, RotatingKVCache   # (engine.kv.cache imports the models)

        caches = self.model.make_cache()
        if self.max_kv_size and all(type(c) is KVCache for c in caches):
            caches = [RotatingKVCache(self.max_kv_size, keep=4) for _ in caches]
        return caches

    def _solo_prefill(self, req: RequestState) -> None:
        from engine.kv.cache import RotatingKVCache   # (engine.kv.cache imports the models)

        if req.whole and req.embeds is not None:    # (the prompt in generate_step's one step)
            req.steps, req.start_decode = req.start_decode(), None
            return
        if req.prompt.size - req.done > 1:
            req.done = prefill_chunk(self.model, req.prompt, req.done, req.caches,
                                     self.policy, self.prefill_step_size,
                                     embeddings=req.embeds)
        if req.prompt.size - req.done > 1:
            return
        # A sliding-window ring that wraps while decoding can no longer be trimmed back to
        # a shared prefix; keep a snapshot at the end of the prompt too (all tokens but
        # the last), so a prompt that branches after it still hits.
        if (req.prefix is None and req.prompt.size > 1
                and any(isinstance(c, RotatingKVCache) for c in req.caches)):
            self._keep(req, req.ids[:len(req.ids) - 1], req.caches)
        req.steps, req.start_decode = req.start_decode(), None

    def _solo_token(self, req: RequestState, tok: int, lp, *_from_draft) -> list:
        out, finished = self._token(req, tok, lp)
        if finished:
            self._live.pop(req.rid, None)
            self._end_solo(req)
        return [out] if out is not None else []

    def _end_solo(self, req: RequestState, store: bool = True) -> None:
        if req.steps is not None:
            req.steps.close()
        if req.spec is not None:
            self.spec.finished(req.rid, req.spec)
        if store:
            self._store(req, req.caches)
        req.steps = req.caches = req.prompt = req.start_decode = req.embeds = None
        self._solo = None
