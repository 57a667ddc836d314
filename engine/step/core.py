"""The engine core: every request of every caller goes through one `Engine`.

    eng = Engine.load(path, max_batch=8)
    rid = eng.submit("def add(a, b):", SamplingParams(max_tokens=64))
    while eng.has_unfinished():
        for out in eng.step():
            print(out.request_id, out.text, out.finish_reason)

Each `step()` is one scheduler step (schedule -> execute -> update):

1. **schedule** — waiting requests start in arrival order within their lane. A request is a
   row of the continuous batch (`engine.step.batch.BatchScheduler`: the *batch* runner, or
   with a fast lever the *fast* runner, its decode on `engine.fast`) or runs alone (the *exact*
   runner: `engine.step.stepper.generate_step`, the token loop of `mlx_lm.generate`): alone
   when `max_batch` is 1 at L1, when the KV cache is quantized, when it selects adapters (the
   batch runs the base weights), brings its own prefix caches or speculates with a draft model
   (`engine.step.draft`) or with prompt lookup where the batch cannot take it
   (`engine.step.lookup`; on the batch and fast runners lookup and draft-model requests are
   speculating rows, `engine.step.batch_lookup`, `batch_draft`; a request with images is a
   row of the L1 batch runner, `batch_vision`, and runs alone on the fast runner or in
   deterministic mode); `stats()["solo_reasons"]` counts why. Rows join while the aggregate
   memory estimate fits (a lone row always runs) and at most `max_batch` are in the batch
   (the rest wait, `stats()["waiting"]`). A request running alone runs beside the batch (one
   at a time); one that samples from a seed waits for the batch to drain and holds later batch
   requests back, so its draws are its own.
2. **execute** — one unit of the request running alone (a prefill chunk or a token) and
   one batch step, side by side.
3. **update** — one function for every runner (`_token`): EOS, length, stop strings,
   the text a token makes final, logprobs, the finish reason; a finished request's KV
   goes to the prompt cache (a batch row's leaves the batch by `BatchScheduler.retire`).

A failure in one request's own code (its processors, sampler, detokenizing) ends that
request only (`finish_reason "error"`, `RequestOutput.error`). `submit()` raises `ValueError`
(bad prompt, `ContextLengthExceeded`, `ContextOverBudget`) before anything runs and caps
`max_tokens` at the context the prompt leaves.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Optional

from engine import deterministic as determinism
from engine.models.bucketed_sdpa import warm_next
from engine.step.batch import BatchScheduler, RowEvent
from engine.kv.quant import make_policy
from engine.step.request import (PromptError, RequestOutput, RequestState, SamplingParams,
                      check_token_ids, encode_prompt, model_context, model_vocab_size,
                      token_logprob)
from engine.step.alone import AloneRunner
from engine.step.lane import BatchLane
from engine.step.lookup import lookup_unsupported
from engine.step.context import ContextLimits
from engine.step.reuse import PrefixReuse
from engine.step.vision import VisionPrompts

__all__ = ["Engine"]

BASE_NAMESPACE = "base"


class Engine(AloneRunner, BatchLane, PrefixReuse, ContextLimits, VisionPrompts):
    """Model, tokenizer, prompt cache, admission, adapters and the scheduler.

    max_batch: most requests decoding together (1: one at a time, each exactly
    `mlx_lm.generate`'s token loop). prompt_cache: an `engine.PromptCache` (or
    None). admission: an `engine.step.admission.Admission` (None: no memory check).
    adapters: the adapter registry (`engine.adapters.registry.AdapterRegistry`), needed only
    for requests that select adapters. keep_logprob_arrays: outputs carry each token's
    log-softmax vector [V]. levers: an `engine.levers.Levers` (None: L1); a fast-decode lever
    (tier l3) puts every decode step on the fast runner (`engine.fast`, rows in a
    `SlotPool`, max_batch 1 too); `merged_proj` merges q/k/v and gate/up once for both lanes
    (`engine.fast.apply.prepare`). draft_model: a model of the same vocabulary
    drafting for speculative decoding (`engine.step.draft`; its tokenizer, when given as
    draft_tokenizer, is checked; `admission` should count it: `Admission.with_draft`).
    draft_levers: the draft's own levers: with a fast-decode lever the batch rows' draft
    steps run on the fast runner (`engine.step.fast_draft`; the outputs stay the model's).
    draft_max_rows: drafting pauses while more rows decode (greedy and exact-scheme rows).
    deterministic: every row's logits bit-identical whatever else is in the batch, every
    batchable request a batch row, max_batch 1 too (`engine.deterministic`). prefill_budget:
    prompt tokens a batch step prefills, shared by the rows prefilling (default:
    prefill_step_size; 0: each row prefill_step_size, as mlx-lm's BatchGenerator; on models
    with sliding-window layers the chunks stay whole and the budget bounds the rows prefilling
    together).
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 1, prompt_cache=None,
                 admission=None, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 quantized_kv_start: int = 0, kv_config=None, prefill_step_size: int = 2048,
                 prefill_batch_size: int = 8, adapters=None, keep_logprob_arrays: bool = False,
                 levers=None, max_context: Optional[int] = None,
                 max_kv_size: Optional[int] = None, disk_cache=None, draft_model=None,
                 draft_tokenizer=None, draft_levers=None, draft_max_rows: Optional[int] = None,
                 deterministic: bool = False,
                 prefill_budget: Optional[int] = -1):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.deterministic = bool(deterministic)
        if self.deterministic:    # (DeterministicUnsupported where it is not built)
            levers = determinism.setup(levers, model, draft_model, kv_bits is not None or kv_config is not None)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch = max_batch
        self.prompt_cache = prompt_cache
        self.disk_cache = disk_cache      # engine.kv.disk_cache.DiskCache (None: RAM only)
        self.admission = admission
        self.adapters = adapters
        self.keep_logprob_arrays = keep_logprob_arrays
        self.levers = levers
        if levers is not None:
            from engine.fast.apply import prepare   # (engine.fast imports the models)
            prepare(model, levers)
        self.prefill_step_size = prefill_step_size
        # prompt tokens one batch step prefills over all its rows (-1: prefill_step_size;
        # None or 0: each row its prefill_step_size, BatchGenerator's schedule). Sliding-window
        # models keep whole chunks (their rings round differently when the chunks change):
        # there the budget bounds how many rows prefill together instead
        self.prefill_budget = prefill_step_size if prefill_budget == -1 else prefill_budget
        self.whole_chunks = self._sliding_windows()
        if max_kv_size is not None and (not isinstance(max_kv_size, int) or max_kv_size < 1):
            raise ValueError(f"max_kv_size must be a positive integer, got {max_kv_size!r}")
        self.max_kv_size = max_kv_size
        # tokens a request may span (prompt + generated): the model's own context by default
        self.max_context = max_context if max_context is not None else model_context(model)
        self.vocab_size = model_vocab_size(model)   # prompt ids are checked against it
        self.policy = make_policy(model, kv_bits=kv_bits, kv_group_size=kv_group_size,
                                  quantized_kv_start=quantized_kv_start, kv_config=kv_config)
        self.eos = set(tokenizer.eos_token_ids)
        self.prefill_batch_size = min(max_batch, prefill_batch_size)
        # the runners: exact (mlx-lm's token loop, one request: stepper.generate_step), batch
        # (BatchGenerator's steps, L1) or fast (the batch's decode on engine.fast's step, L3:
        # any number of rows, max_batch 1 included)
        from engine.fast.apply import fast_step_for   # (engine.fast imports the models)
        self._fast_step = fast_step_for(model, levers, self.policy)
        self._set_draft(draft_model, draft_tokenizer)   # (engine.step.alone)
        batching = max_batch > 1 or self._fast_step is not None or self.deterministic
        # draft-model requests as rows of the batch (engine.step.batch_draft): the batch and
        # fast runners (the fast one verifies in its own step: engine.fast.slots.verify) outside
        # deterministic mode; there they run alone (engine.step.draft: their drafts never
        # depend on other rows)
        self.draft_rows = batching and draft_model is not None and not self.deterministic
        # the draft's steps of those rows on the fast runner (engine.step.fast_draft)
        self.draft_step = fast_step_for(draft_model, draft_levers) if self.draft_rows else None
        if draft_max_rows is not None and (not isinstance(draft_max_rows, int) or draft_max_rows < 1):
            raise ValueError(f"draft_max_rows must be a positive integer, got {draft_max_rows!r}")
        self.draft_max_rows = draft_max_rows
        self._sched = self._new_scheduler() if batching else None
        # prompt lookup as a row of the batch (engine.step.batch_lookup): the batch or fast
        # runner over full-attention caches; in deterministic mode a lookup request runs alone
        self.lookup_rows = (self._sched is not None and not self.deterministic
                            and lookup_unsupported(model) is None)
        # a request with images as a row of the batch (its prompt prefilled from its merged
        # embeddings, engine.step.batch_vision): the L1 batch runner; elsewhere it runs alone
        self.image_rows = (self._sched is not None and self._fast_step is None
                           and not self.deterministic)
        # a request with runtime adapters as a row (engine.adapters.rows): the L1 batch runner
        self.adapter_rows = self._sched is not None and self._fast_step is None
        self._ids = itertools.count()
        self._waiting: deque = deque()
        self._live: dict = {}            # rid -> RequestState (waiting or running)
        self._rows: dict = {}            # batch uid -> RequestState
        self._solo: Optional[RequestState] = None
        self._done_now: list = []        # outputs to hand out with the next step
        self._ended_len = 0              # the last ended request's tokens (`idle`)
        self._samplers: dict = {}
        self.steps = 0
        self.peak_rows = 0               # most rows that ran one decode forward together
        self.rows_now = 0                # rows decoding now (they run the next decode step)
        self.lanes = {"batch": 0, "solo": 0}
        self.solo_reasons: dict = {}
        from engine.step.speculation import Speculation
        self.spec = Speculation()        # speculation's counters (prompt lookup, draft model)

    def _new_scheduler(self) -> BatchScheduler:
        # (no tokenizer, no stop tokens, no max_tokens: rows end by the Engine's update)
        return BatchScheduler(self.model, tokenizer=None, eos_token_ids=(),
                              completion_batch_size=self.max_batch,
                              prefill_batch_size=self.prefill_batch_size,
                              prefill_step_size=self.prefill_step_size,
                              prefill_budget=self.prefill_budget, whole_chunks=self.whole_chunks,
                              decoder=self._fast_step, deterministic=self.deterministic,
                              draft_model=self.draft_model if self.draft_rows else None,
                              draft_decoder=self.draft_step, draft_max_rows=self.draft_max_rows,
                              first_at_graduate=True, kv_layers=self.policy.layers)

    @property
    def fast_step(self):   # the fast runner's step in force (None: the rows decode on L1)
        return self._fast_step

    @classmethod
    def load(cls, path, **kw):
        """Load a model directory into an Engine (`engine.step.loading.load_engine`: memory
        admission, prompt cache, adapters, a draft model, tensor parallelism)."""
        from engine.step.loading import load_engine
        return load_engine(cls, path, **kw)

    # --- requests -----------------------------------------------------------------

    def submit(self, prompt, params: Optional[SamplingParams] = None, *, request_id=None,
               adapter=(), tools=None, template_kwargs=None,
               cache_namespace: Optional[str] = None, prefix_caches=None, vision=None) -> str:
        """Queue a request (text, token ids or chat messages); returns its id.

        adapter: adapter ids to run with (a tuple; needs `adapters`).
        prefix_caches: per-layer caches that already hold the context before `prompt`
        (e.g. `engine.kv.cache_file.load_prompt_cache`); the request runs on them (one at a
        time) and they are not stored in the prompt cache.
        vision: the prompt's images (`vision_prompt` makes the ids and it); a row of the batch
        where `image_rows` (else it runs alone, `solo_reasons["images"]`)."""
        params = (params or SamplingParams()).resolved(self.tokenizer)
        ids = encode_prompt(self.tokenizer, prompt, tools, template_kwargs)
        if not ids:
            raise PromptError("the prompt encodes to no tokens")
        check_token_ids(ids, self.vocab_size)
        before = prefix_caches[0].offset if prefix_caches else 0
        self.check_context(before + len(ids))
        params = self.capped(params, before + len(ids))
        if params.prompt_lookup and self.draft_model is not None:
            raise ValueError("prompt_lookup: this engine speculates with its draft model")
        why = lookup_unsupported(self.model) if params.looks_up() and not self.deterministic else None
        if why:
            raise ValueError(f"prompt_lookup: {why}")
        if self.admission is not None:
            self.admission.check(len(ids), params.max_tokens)
        adapter = tuple(adapter or ())
        if adapter and self.adapters is None:
            raise ValueError("this engine has no adapter registry")
        if adapter and self.deterministic:
            determinism.check_adapters()
        if cache_namespace is None:
            cache_namespace = (self.adapters.namespace(adapter) if self.adapters is not None
                               else BASE_NAMESPACE)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already in use")
        reason = "prefix_caches" if prefix_caches else self._solo_reason(adapter, params)
        if vision is not None:
            self.check_vision(vision, ids)
            cache_namespace = f"{cache_namespace}:images:{vision.digest}"
            if reason is None and not self.image_rows:
                reason = "images"
            if reason is None and self.policy.active:      # (quantized KV rows: text only)
                reason = "kv_quant"
        req = RequestState(rid, ids, params, adapter, cache_namespace,
                       "batch" if reason is None else "solo", self.tokenizer)
        req.prefix, req.vision = prefix_caches or None, vision
        # images the decoder attends to both ways: the prompt in one forward from empty caches
        req.whole = vision is not None and getattr(self.model, "whole_image_prompts", False)
        if req.whole and req.prefix is not None:
            raise PromptError("prefix caches are not supported with images this model's "
                              "decoder attends to both ways")
        # sampling from the global seeded stream alone: the batch's draws must not interleave
        req.exclusive = req.lane == "solo" and params.seed is not None and bool(params.temperature)
        # (copied on write: stats() may be read from another thread)
        if reason is not None:
            self.solo_reasons = {**self.solo_reasons, reason: self.solo_reasons.get(reason, 0) + 1}
        self.lanes = {**self.lanes, req.lane: self.lanes[req.lane] + 1}
        self._live[rid] = req
        self._waiting.append(req)
        return rid

    def _solo_reason(self, adapter: tuple, params: SamplingParams) -> Optional[str]:
        if self._sched is None:
            return "max_batch=1"
        if params.looks_up() and not self.lookup_rows:    # (else a batch row drafts)
            return "prompt_lookup"
        if self.draft_model is not None and params.drafts() and not self._draft_row(params):
            return "draft_model"
        if self.max_kv_size:
            return "max_kv_size"
        if self.policy.active and not self._quant_row(params):
            return "kv_quant"
        if adapter and not self.adapter_rows:
            return "adapters"
        return None

    def abort(self, request_id) -> bool:
        """End a request now; its last output (finish_reason "cancelled") comes with
        the next `step()`. False if it is unknown or already finished."""
        req = self._live.pop(str(request_id), None)
        if req is None:
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        elif req is self._solo:     # (a prompt not fully prefilled is not stored)
            self._end_solo(req, store=req.steps is not None)
        elif req.uid is not None:
            self._sched.cancel(req.uid)
            self._row_ended(self._rows.pop(req.uid, req))
        self._done_now.append(req.output("", "cancelled"))
        return True

    @property
    def batching(self) -> bool:
        """Whether requests can run as batch rows (max_batch > 1; quantized KV: `quant_rows`)."""
        return self._sched is not None and (not self.policy.active or self.quant_rows)

    def has_unfinished(self) -> bool:
        return bool(self._live or self._done_now)

    def idle(self) -> bool:
        """Between requests (engine-serve calls it): on CUDA, run the attention shape the next
        turn of the request that ended last would take (`bucketed_sdpa.warm_next`)."""
        n, self._ended_len = self._ended_len, 0
        return bool(n) and not self.has_unfinished() and warm_next(n)

    def stats(self) -> dict:
        """Counters (safe to read from another thread than the one stepping). active_rows:
        requests handed to the batch (queued in it, prefilling or decoding); rows_now: rows
        decoding now (a solo request decoding is one); peak_rows: most rows that ran one
        decode forward together."""
        return {"max_batch": self.max_batch, "deterministic": self.deterministic,
                "active_rows": len(self._rows),
                "solo_active": self._solo is not None, "waiting": len(self._waiting),
                "steps": self.steps, "peak_rows": self.peak_rows, "rows_now": self.rows_now,
                "lanes": dict(self.lanes), "solo_reasons": dict(self.solo_reasons),
                "speculation": dict(self.spec.stats(), draft_runner=(
                    None if self.draft_model is None else "fast" if self.draft_step else "l1"),
                    # (the draft's fast runner: its traces, as "fast" counts the model's)
                    draft_fast=dict(vars(self.draft_step.stats)) if self.draft_step else None),
                # the fast runner's counters: traces (made only for shapes not seen before)
                "fast": (dict(vars(self._fast_step.stats)) if self._fast_step is not None
                         else None)}

    # --- the loop ------------------------------------------------------------------

    def step(self) -> list:
        """One scheduler step; the outputs it produced (a request appears at most once).

        schedule (`_schedule`) -> execute: one unit of the request running alone (a prefill
        chunk or a token: the exact runner) and one step of the batch (the batch or the fast
        runner), side by side -> update (`_update`, the same for both)."""
        outs, self._done_now = self._done_now, []
        outs += self._schedule()
        solo = self._solo
        decoded = 0                        # rows in this step's decode forwards
        if solo is not None:
            try:      # the forward runs right below here (one frame to the model)
                if self.adapters is not None:
                    self.adapters.activate(solo.adapters)
                if solo.steps is None:
                    self._solo_prefill(solo)   # one chunk per step: abort() lands between chunks
                else:
                    decoded = 1
                    outs += self._solo_token(solo, *next(solo.steps))
            except Exception as e:         # a fault: the request running alone ends
                self._end_solo(solo, store=False)
                outs.append(self._fail(solo, e))
        if self._sched is not None and self._sched.has_work():
            try:
                if self.adapters is not None:
                    self.adapters.activate(())
                events = self._sched.step()
                decoded += self._sched.decoded_rows
                outs += self._batch_events(events)
            except Exception as e:         # a fault: every row of the batch ends
                rows = list(self._rows.values())
                self._sched, self._rows = self._new_scheduler(), {}
                for r in rows:
                    self._row_ended(r)
                    outs.append(self._fail(r, e))
        self.steps += 1
        self._ended_len = next((o.prompt_tokens + o.generation_tokens for o in outs if o.finished
                                and o.started), self._ended_len)
        self.peak_rows = max(self.peak_rows, decoded)
        self.rows_now = ((1 if self._solo is not None and self._solo.steps is not None else 0)
                         + (self._sched.decoding if self._sched is not None else 0))
        return outs

    def _schedule(self) -> list:
        """Start waiting requests, in arrival order within each lane: a request that runs
        alone starts when no other one does (beside the batch, which keeps decoding); a batch
        request joins while `max_batch` and the aggregate memory estimate allow (a later batch
        request never passes an earlier one). One exception keeps seeded sampling
        reproducible: a request that samples from the global seeded stream (a seed,
        temperature > 0) running alone starts only once the batch has drained, and batch
        requests after it wait for it."""
        failed = []
        batch_blocked = False
        for req in list(self._waiting):
            if req.lane == "solo":
                if self._solo is not None:
                    batch_blocked = batch_blocked or req.exclusive
                    continue
                if req.exclusive and self._rows:
                    batch_blocked = True
                    continue
                self._waiting.remove(req)
                try:
                    self._start_solo(req)
                except Exception as e:     # (an adapter unmounted since submit, ...)
                    failed.append(self._fail(req, e))
                if req.exclusive:
                    batch_blocked = True
                continue
            if batch_blocked or (self._solo is not None and self._solo.exclusive):
                continue
            if len(self._rows) >= self.max_batch or (
                    self._rows and not self.batch_fits([r.need for r in self._rows.values()]
                                                       + [req.need])):
                batch_blocked = True       # (later batch requests keep their turn)
                continue
            self._waiting.remove(req)
            try:
                self._start_row(req)
            except Exception as e:         # (its processors, sampler or seed): this row only
                failed.append(self._fail(req, e))
        return failed

    def batch_fits(self, needs: list) -> bool:
        """Aggregate admission (`Admission.batch_fits`): whether rows of these context lengths
        fit together (on the fast runner every row of the bucket the step runs counts)."""
        if self.admission is None:
            return True
        held = self._fast_step.rows_for(len(needs)) if self._fast_step is not None else len(needs)
        return self.admission.batch_fits(needs, held)

    def _sampler(self, params: SamplingParams):
        key = params.sampler_key()
        if key not in self._samplers:     # one object per setting: batched sampler calls
            special = []
            if params.xtc_probability:
                special = sorted(self.eos) + list(self.tokenizer.encode("\n",
                                                                        add_special_tokens=False))
            self._samplers[key] = params.make_sampler(special)
        return self._samplers[key]

    # --- update (every runner) --------------------------------------------------------

    def _token(self, req: RequestState, tok: int, lp) -> tuple:
        """The one update of a token from any runner: EOS, length, stop strings, the text
        it makes final, logprobs, the finish reason. Returns (the output to hand out or
        None, whether the request finished)."""
        ev = RowEvent(req.uid if req.uid is not None else -1, tok, lp)
        if len(req.fed) + 1 >= req.params.max_tokens:
            ev.finish_reason = "length"
        if tok in self.eos:
            ev.finish_reason, ev.stop_token = "stop", True
        text, hit = req.text.feed(None if ev.stop_token else tok, ev.finish_reason is not None)
        if hit:
            ev.finish_reason, ev.stop_string = "stop", req.text.stop_string
        ev.text = text
        return self._update(req, ev), ev.finish_reason is not None

    def _update(self, req: RequestState, ev: RowEvent) -> Optional[RequestOutput]:
        if ev.token is not None:
            req.fed.append(ev.token)
            if len(req.fed) == 1:
                now = req.first_at = time.perf_counter()
                req.prompt_tps = (len(req.ids) - req.reused) / max(now - req.tic, 1e-9)
                req.tic = now
            if not ev.stop_token:
                req.n += 1
                req.pending_ids.append(ev.token)
                if self.keep_logprob_arrays:
                    req.pending_arrays.append(ev.logprobs)
                if req.params.wants_logprobs:
                    req.pending_lp.append(token_logprob(ev.token, ev.logprobs, req.top))
        if ev.finish_reason is None and not ev.text:
            return None
        return req.output(ev.text, ev.finish_reason, stop_string=ev.stop_string)

    def _fail(self, req: RequestState, e: BaseException) -> RequestOutput:
        self._live.pop(req.rid, None)
        return req.output("", "error", error=e)
