"""The batch runner's side of `engine.step.core.Engine`: a request that is a row of the
continuous batch (`engine.step.batch.BatchScheduler`) joins it (`_start_row`), and each step's
row events go through the Engine's one update (`_token`); rows that finished leave the batch
together (`BatchScheduler.retire`), their KV to the prompt cache.

A greedy request with prompt lookup is a speculating row (`engine.step.batch_lookup`) where the
batch can take it (`lookup_rows`: the batch or fast runner, full-attention caches, not deterministic
mode): it may hand out several tokens in one step, one event each; once the update ends it (EOS,
a stop string, max_tokens), the rest of that step's tokens are dropped and trimmed from the KV
it leaves to the prompt cache. A greedy request with the engine's draft model is a speculating
row the same way (`engine.step.batch_draft`, where `draft_rows`: the batch or fast runner; greedy or
sampled, by mlx-lm's scheme or the speculative-sampling rule).

A request whose images the decoder attends to both ways (`req.whole`: Gemma 4's
`use_bidirectional_attention: "vision"`) has its whole prompt run in one forward from empty
caches before it joins (`_whole_prefill`: the forward in which the model lets each image's
tokens attend to each other, as the request alone and mlx-vlm run it); it joins with those caches
and graduates on that forward's last logits (`BatchRequest.first_logits`). Its KV goes to the
prompt cache when it ends; a later request with the same images reuses it where every image
token is in the reused prefix (`engine.step.reuse`), as alone."""

from __future__ import annotations

import time

import mlx.core as mx

from engine.step.batch import BatchRequest
from engine.step.batch_draft import RowDraft
from engine.step.batch_lookup import RowLookup
from engine.step.request import RequestState


class BatchLane:
    """Mixed into `engine.step.core.Engine` (its scheduler, rows, prompt cache and speculation
    counters)."""

    def _start_row(self, req: RequestState) -> None:
        if self.adapters is not None:
            self.adapters.activate(())
        p = req.params
        caches = self._fetch(req)
        lookup = draft = None
        if p.looks_up(batch_row=self.lookup_rows):   # (only where `lookup_rows`: else alone)
            req.spec = self.spec.for_request("lookup")
            lookup = RowLookup(p.prompt_lookup, p.num_draft_tokens, limit=p.max_tokens,
                               stats=req.spec)
        elif self._draft_row(p) and req.vision is None:   # (images: no drafts, as alone)
            req.spec = self.spec.for_request("draft")
            draft = RowDraft(p.num_draft_tokens, limit=p.max_tokens, stats=req.spec,
                             rejection=p.spec_sampling == "rejection")
        if self.adapters is not None and req.vision is not None:
            self.adapters.activate(req.adapters)   # (an adapter may target the vision tower)
        embeds = self.prompt_embeddings(req)   # images merged in (None: no images to embed)
        skip, first = 0, None    # prompt tokens in `caches` that are not a prompt-cache hit
        if req.whole:
            caches, first = self._whole_prefill(req, embeds)
            skip, embeds = len(req.ids) - 1, None
        if self.adapters is not None:
            self.adapters.activate(())
        snapshot = None
        if req.vision is not None and self._sliding_windows() and not req.whole:
            # (as the alone path does: a sliding-window ring that wraps while decoding can no
            # longer be trimmed back to the prompt, so the prompt is kept when prefilled)
            def snapshot(caches, req=req):
                self._keep(req, req.ids[:len(req.ids) - 1], caches)
        req.tic = time.perf_counter()
        req.uid = self._sched.submit(BatchRequest(
            req.ids[req.reused + skip:], max_tokens=None, sampler=self._sampler(p),
            seed=p.seed, logits_processors=p.make_processors(),
            caches=caches, history=req.ids[:req.reused + skip], lookup=lookup, draft=draft,
            embeddings=embeds, positions=self.image_positions(req),
            on_prefilled=snapshot, adapters=req.adapters, first_logits=first,
            return_cache=self.prompt_cache is not None or self.disk_cache is not None))
        self._rows[req.uid] = req

    def _whole_prefill(self, req: RequestState, embeds) -> tuple:
        """(fresh caches holding `req`'s whole prompt, its last token's logits [1, V]) from one
        forward over it with its input embeddings (images merged in), under the adapters active."""
        caches = self.model.make_cache()
        logits = self.model(mx.array([req.ids]), cache=caches, input_embeddings=embeds)[:, -1, :]
        mx.eval(logits, [c.state for c in caches])
        return caches, logits

    def _draft_row(self, p) -> bool:
        """Whether a request with these (resolved) params speculates with the draft model as
        a row of the batch: drafting (`SamplingParams.drafts`), greedy or sampled (either
        `spec_sampling`), with `verifiable` processors (each draft position processed as a
        single step: `engine.step.batch_lookup`), where `draft_rows`."""
        return self.draft_rows and p.drafts(processors=True)

    @property
    def quant_rows(self) -> bool:
        """Whether requests with the engine's quantized KV are rows of the batch
        (`engine.kv.batch_quant`): the L1 batch runner (not deterministic mode), KV quantized
        from the first token (`quantized_kv_start` 0, the server's), every quantized layer a
        full-attention one."""
        if getattr(self, "_quant_rows", None) is None:
            from engine.kv.cache import KVCache   # (engine.kv.cache imports the models)
            kinds = self.model.make_cache()
            self._quant_rows = bool(
                self._sched is not None and self.policy.active and self.policy.start == 0
                and self._fast_step is None and not self.deterministic
                and all(type(kinds[i]) is KVCache for i in self.policy.layers))
        return self._quant_rows

    def _quant_row(self, p) -> bool:
        """Whether a request with these params is a row with quantized KV: `quant_rows` (a
        prompt-lookup row too: its rejected drafts leave the quantized caches as the float
        ones', `BatchKVCache.rewind`; a draft model is refused with quantized KV)."""
        return self.quant_rows and not (self.draft_model is not None and p.drafts())

    def _sliding_windows(self) -> bool:
        """Whether the model's caches have sliding-window rings."""
        from engine.kv.cache import RotatingKVCache   # (engine.kv.cache imports the models)

        if getattr(self, "_rings", None) is None:
            self._rings = any(isinstance(c, RotatingKVCache) for c in self.model.make_cache())
        return self._rings

    def _row_ended(self, req: RequestState) -> None:
        if req.spec is not None:     # (a speculating row's counts among the recent ones)
            self.spec.finished(req.rid, req.spec)

    def _batch_events(self, events) -> list:
        outs, ended = [], []
        unused: dict = {}             # uid -> its tokens this step after it ended (dropped)
        for ev in events:
            req = self._rows.get(ev.uid)
            if req is None:           # aborted (its output was made then)
                continue
            if ev.uid in unused:      # ended by an earlier token of this step
                unused[ev.uid] += 1
                continue
            if ev.finish_reason == "error":   # this row's own code raised: it ends alone
                del self._rows[ev.uid]
                self._row_ended(req)
                outs.append(self._fail(req, ev.error))
                continue
            try:
                out, finished = self._token(req, ev.token, ev.logprobs)
            except Exception as e:    # (its detokenizer): this row only
                out, finished = self._fail(req, e), None
                ended.append((req, False))
                unused[ev.uid] = 0
            if finished:
                ended.append((req, True))
                unused[ev.uid] = 0
                self._live.pop(req.rid, None)
            if out is not None:
                outs.append(out)
        if ended:                     # one filter of the batch for every row that ended
            caches = self._sched.retire([r.uid for r, _ in ended], unused)
            for req, store in ended:
                del self._rows[req.uid]
                self._row_ended(req)
                if store and caches.get(req.uid) is not None:
                    self._store(req, caches[req.uid])
        return outs
