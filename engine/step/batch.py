"""Continuous batching: one scheduler loop over rows (schedule -> one step -> update).

Each call to `BatchScheduler.step()` does, in this order (mlx-lm 0.32.2
BatchGenerator's schedule, so the same inserts give the same forwards):

1. **decode** — one forward over every generating row (its last sampled token; over
   [B, K + 1] when rows speculate with prompt lookup, `engine.step.batch_lookup`, or with
   a draft model, `engine.step.batch_draft`),
   sample each row's next token with its own sampler / PRNG key / processors,
   emit each row's *current* token with its logprobs (the step is pipelined:
   the token emitted now was sampled by the previous forward), and drop rows
   that finished (EOS or stop token, stop string, `max_tokens`: with a tokenizer,
   stop tokens and a `max_tokens`; the Engine gives none and ends rows itself,
   after its one update for every runner, with `retire`);
2. **admit** — queued requests join the prefill group (bounded by `prefill_batch_size` and
   `completion_batch_size`), their caches stacked right-aligned and appended;
3. **graduate** — rows whose prompt is consumed but its last token: one forward of that
   token gives their first sampled token, and they join the decode group (with
   `first_at_graduate`, rows the caller ends itself hand that token out now, not with the
   next decode step; a row then retired still runs in that forward, as in BatchGenerator,
   unless no other row does);
4. **prefill** — one chunk (<= `prefill_step_size` tokens per row) of every
   remaining prompt, right-padded to the longest, then rolled to left padding,
   so long prompts never stall the decoding rows for more than one chunk.

`cancel(uid)` removes a row between steps; a server lane drives `step()` from one thread.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Iterable, Iterator, List, Optional, Sequence

import mlx.core as mx

from engine.adapters.rows import selected
from engine.kv.batch_cache import batch_caches
from engine.kv.batch_quant import batch_caches_q, quantize_group
from engine.kv.cache import temporal_caches
from engine.step.batch_types import BatchRequest, RowEvent
from engine.step.batch_draft import DraftBatch
from engine.step.batch_lookup import LookupSteps
from engine.step.batch_rows import Group, Row, eval_caches, extract_row, guarded, pooled
from engine.step.batch_vision import bind_row_positions, embedding_kwargs
from engine.step.lookup import lookup_unsupported
from engine.step.row_processors import apply_processors, batched
from engine.step.sampling import greedy

__all__ = ["BatchRequest", "RowEvent", "BatchScheduler", "batch_generate"]

PREFILL_BUCKET = 64


class BatchScheduler(LookupSteps):
    """Continuous batching over `model(inputs [B, T], cache=list) -> logits`.

    completion_batch_size: most rows decoding at once; prefill_batch_size: most
    rows prefilling at once; prefill_step_size: prompt tokens per row per step.
    eos_token_ids: default stop tokens (the tokenizer's if given). decoder: the fast
    runner's step (`engine.fast.decode.FastStep`, L3) or None: with it the decoding rows
    keep their KV in a slot pool (`engine.fast.slots.SlotPool`) and every decode step is
    the fast step; prefill and a row's first step always run the model (L1).
    deterministic: every row's sliding-window caches keep temporal order
    (`engine.kv.cache.temporal_caches`; engine.deterministic says why).
    A row with `lookup` speculates (`engine.step.batch_lookup`; with a decoder: `SlotPool.verify`).
    draft_model: a model of the same vocabulary drafting for rows with `draft`
    (`engine.step.batch_draft`; refused in deterministic mode).
    draft_decoder: the draft model's fast step, or None: with it the draft's steps run on the
    fast runner (`engine.step.fast_draft`; the rows' tokens are the model's: it verifies).
    draft_max_rows: drafting pauses while more rows decode (`LookupSteps.drafting_paused`).
    first_at_graduate: a row with no scheduler-side ending (no max_tokens, stop tokens or
    tokenizer: the Engine's rows) emits its first token when it graduates.
    kv_layers: a KV policy's quantized layers (cache index -> (bits, group size)), quantized
    from the first token: the rows' caches of those layers become quantized after their first
    forward (`engine.kv.batch_quant`), as a request's alone; rows join the prefill group only
    while it is empty, and only rows of one kind together (fresh ones, or prompt-cache hits
    already quantized), so a group's rows convert together; they decode together.
    """

    def __init__(self, model, *, tokenizer=None, eos_token_ids: Optional[Iterable[int]] = None,
                 completion_batch_size: int = 32, prefill_batch_size: int = 8,
                 prefill_step_size: int = 2048, decoder=None, deterministic: bool = False,
                 draft_model=None, draft_decoder=None, prefill_budget: Optional[int] = None,
                 first_at_graduate: bool = False, kv_layers: Optional[dict] = None,
                 whole_chunks: bool = False, draft_max_rows: Optional[int] = None):
        self.model, self.draft_max_rows = model, draft_max_rows
        self.kv_layers = kv_layers or {}
        self.first_at_graduate = first_at_graduate
        self.decoder = decoder
        self.deterministic = deterministic
        self.tokenizer = tokenizer
        if eos_token_ids is None and tokenizer is not None:
            eos_token_ids = tokenizer.eos_token_ids
        self.eos = set(int(t) for t in (eos_token_ids or ()))
        self.prefill_batch_size = prefill_batch_size
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.prefill_step_size = prefill_step_size
        self.prefill_budget = prefill_budget    # prompt tokens a step, all rows (None: per row)
        self.whole_chunks = whole_chunks        # (the budget admits rows, chunks stay whole)
        # the fast runner (L3) pads prompt chunks to a multiple of PREFILL_BUCKET tokens: on
        # CUDA a new chunk length costs a new attention plan (cuDNN: 45-90 ms on an H100),
        # so repeating lengths keep the first token fast; L1 pads as BatchGenerator does
        self.prefill_bucket = PREFILL_BUCKET if decoder is not None else 0
        self._queue: deque[Row] = deque()
        self._prefill = Group()
        pool = None
        if decoder is not None:
            from engine.fast.slots import SlotPool   # (engine.fast imports the models)
            pool = SlotPool(decoder, model)
        self._decode = Group(pool)
        if draft_model is not None:
            if deterministic:
                raise ValueError("draft-model rows are not taken in deterministic mode")
            if draft_decoder is None:
                self._decode.draft = DraftBatch(draft_model, prefill_step_size)
            else:
                from engine.step.fast_draft import FastDraftBatch   # (engine.fast: the models)
                self._decode.draft = FastDraftBatch(draft_model, draft_decoder, prefill_step_size)
        self._uid = 0
        self._cancelled: List[RowEvent] = []
        self.steps = 0
        self.decoded_rows = 0     # rows in the last step's decode forward (0: none ran)

    # -- requests -----------------------------------------------------------------
    def submit(self, req: BatchRequest) -> int:
        if not len(req.prompt):
            raise ValueError("empty prompt")
        if req.max_tokens is not None and req.max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")
        for name, spec in (("prompt lookup", req.lookup), ("a draft model", req.draft)):
            if spec is None:
                continue
            why = ("not in deterministic mode" if self.deterministic
                   else "its logits processors are neither grammars nor built-in" if any(
                       not (hasattr(p, "masks_ahead") or getattr(p, "pure", False))
                       for p in req.logits_processors)
                   else lookup_unsupported(self.model)
                   or ("the scheduler has no draft_model" if req.draft is not None
                       and self._decode.draft is None else None)
                   or ("one source of drafts" if req.lookup is not None
                       and req.draft is not None else None))
            if why:
                raise ValueError(f"{name} in the batch: {why}")
        if req.embeddings is not None and req.embeddings.shape[1] != len(req.prompt):
            raise ValueError(f"embeddings for {req.embeddings.shape[1]} tokens, the prompt "
                             f"has {len(req.prompt)}")
        if req.positions is not None and self.decoder is not None:
            raise ValueError("a row with its own positions needs the L1 batch runner")
        stops = self.eos if req.stop_tokens is None else set(int(t) for t in req.stop_tokens)
        row = Row(self._uid, req, stops, self.tokenizer)
        self._uid += 1
        self._queue.append(row)
        return row.uid

    def cancel(self, uid: int) -> bool:
        """Remove a row now; its final event (finish_reason "cancelled") comes with the next step."""
        for row in self._queue:
            if row.uid == uid:
                self._queue.remove(row)
                self._cancelled.append(RowEvent(uid, None, None, "cancelled"))
                return True
        for g in (self._prefill, self._decode):
            for i, row in enumerate(g.rows):
                if row.uid == uid:
                    g.filter([j for j in range(len(g)) if j != i])
                    self._cancelled.append(RowEvent(uid, None, None, "cancelled"))
                    return True
        return False

    @property
    def active(self) -> int:
        return len(self._prefill) + len(self._decode)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def decoding(self) -> int:
        """Rows in the decode group: those that run the next decode forward together."""
        return len(self._decode)

    def has_work(self) -> bool:
        return bool(self._queue or self._prefill.rows or self._decode.rows or self._cancelled)

    def kv_nbytes(self) -> int:
        draft = self._decode.draft.nbytes if self._decode.draft is not None else 0
        return draft + sum(g.caches.nbytes if pooled(g.caches) else
                           sum(c.nbytes for c in g.caches) for g in (self._prefill, self._decode))

    # -- the loop -----------------------------------------------------------------
    def step(self) -> List[RowEvent]:
        events, self._cancelled = self._cancelled, []
        if self._decode.rows and all(r.retired for r in self._decode.rows):  # (after a cancel)
            self._decode.filter([])
        self.decoded_rows = len(self._decode)
        if self._decode.rows:
            events += self._decode_step()
        self.steps += 1
        if len(self._decode) >= self.completion_batch_size:
            return events
        self._admit()
        ready = [i for i, r in enumerate(self._prefill.rows) if not r.pending]
        if ready:
            events += self._graduate(ready)
        if self._prefill.rows:
            self._prefill_chunk()
        return events

    def run(self) -> Iterator[RowEvent]:
        while self.has_work():
            yield from self.step()

    # -- phases ---------------------------------------------------------------------
    def _sample(self, g: Group, inputs: mx.array, logits: mx.array):
        """g's rows' next tokens from one decode forward's logits [B, V] on inputs [B]
        (the callers run the forward themselves: one frame less between the engine's step
        and the model); returns (sampled [B], logprobs [B, V])."""
        rows = g.rows
        if any(r.req.logits_processors for r in rows):
            logits = self._process(g, rows, inputs, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        s0 = rows[0].sampler
        if all(r.key is None and r.sampler is s0 for r in rows):
            sampled = s0(logprobs)                     # one batched call (global PRNG)
        else:
            sampled = mx.concatenate([guarded(r, r.sample, greedy, logprobs[e:e + 1])
                                      for e, r in enumerate(rows)])
        return sampled, logprobs

    def _process(self, g: Group, rows, inputs, logits):
        """Each row's logits processors, in its list order. A leading run of logit-bias
        processors is applied to all rows at once (one scatter-add of every row's
        (row, token, bias); per element the same `at[].add` as row by row, so the same
        values: L1-tested); the rest run row by row on that row's slice."""
        uids = tuple(r.uid for r in rows)
        if g.procs_key != uids:
            g.procs_key, g.procs = uids, batched([r.req.logits_processors for r in rows])
        bias, rest = g.procs
        if bias is not None:
            r_idx, c_idx, vals, top = bias
            if top >= logits.shape[-1]:
                raise ValueError(f"logit_bias token id {top} is outside the vocabulary "
                                 f"(size {logits.shape[-1]})")
            logits = logits.at[r_idx, c_idx].add(vals)
        if not any(rest):
            return logits
        # the context a row's processors see is its tokens so far plus this step's input
        # (the same values as mlx-lm's); the input joins on the device, because
        # reading `inputs` back to the host here would wait for the step in flight
        out = []
        for e, (r, procs) in enumerate(zip(rows, rest)):
            lg = logits[e:e + 1]
            if procs:
                ctx = mx.concatenate([mx.array(r.tokens, dtype=mx.int32),
                                      inputs[e:e + 1].astype(mx.int32)])
                lg = guarded(r, apply_processors, lambda lg, *_: lg, lg, procs, ctx)
            out.append(lg)
        return mx.concatenate(out, axis=0)

    def _forward(self, g: Group, tokens, **kw):
        """The model over g's rows, each with its own adapters (`engine.adapters.rows`)."""
        bind_row_positions(g.rows, g.caches)   # (rows with their own positions: batch_vision)
        with selected([r.req.adapters for r in g.rows]):
            return self.model(tokens, cache=g.caches, **kw)

    def _decode_step(self) -> List[RowEvent]:
        g = self._decode
        if any(r.spec is not None for r in g.rows) and not self.drafting_paused(g):   # (speculating)
            events = self._lookup_step(g)
            if events is not None:
                return events
        inputs, cur_lp = g.next_tokens, g.next_logprobs
        if pooled(g.caches):                  # the fast runner (L3)
            logits = g.caches(inputs)
        else:
            logits = self._forward(g, inputs[:, None])[:, -1, :]
        sampled, logprobs = self._sample(g, inputs, logits)
        g.next_tokens, g.next_logprobs = sampled, list(logprobs)
        mx.async_eval(g.next_tokens, g.next_logprobs)
        mx.eval(inputs, cur_lp)
        toks = inputs.tolist()
        events, keep = [], []
        for i, (row, tok) in enumerate(zip(g.rows, toks)):
            if self._emit(g, i, row, tok, cur_lp[i], events):
                keep.append(i)
        if len(keep) < len(g):
            g.filter(keep)
        return events

    def _emit(self, g: Group, i: int, row: Row, tok: int, lp, events: list,
              extra: int = 0) -> bool:
        """Hand out token `tok` of row i of g (an event into `events`); False when the row ends
        with it. Its KV, when the row asked for it, then leaves without the `extra` tokens
        after `tok` that are in its cache (an accepted draft run past the end)."""
        row.tokens.append(tok)
        row.n += 1
        if row.early:                      # `tok` went out when the row graduated
            row.early = False
            if row.retired or row.error is None:
                return not row.retired
        ev = RowEvent(row.uid, tok, lp)
        events.append(ev)
        if row.error is not None:          # this row's own code raised: it ends alone
            ev.token, ev.logprobs, ev.finish_reason, ev.error = None, None, "error", row.error
            return False
        if row.req.max_tokens is not None and row.n >= row.req.max_tokens:
            ev.finish_reason = "length"
        if tok in row.stops:
            ev.finish_reason, ev.stop_token = "stop", True
        if row.text is not None:
            guarded(row, self._text, lambda *_: None, row, ev)
            if row.error is not None:
                ev.finish_reason, ev.error = "error", row.error
                return False
        if ev.finish_reason is None:
            return True
        if row.req.return_cache:
            ev.caches = extract_row(g.caches, i)
            for c in ev.caches if extra else ():
                c.trim(extra)
        return False

    def _text(self, row: Row, ev: RowEvent):
        text, hit = row.text.feed(None if ev.stop_token else ev.token,
                                  ev.finish_reason is not None)
        if hit:
            ev.finish_reason, ev.stop_string = "stop", row.text.stop_string
        ev.text = text

    def _admit(self):
        n = min(self.prefill_batch_size - len(self._prefill),
                self.completion_batch_size - len(self._decode), len(self._queue))
        if self.kv_layers and self._prefill.rows:   # (quantized KV: see the class)
            return
        if n <= 0:
            return
        if self.whole_chunks and self.prefill_budget:
            n = self._rows_in_budget(n)
            if n <= 0:
                return
        new = Group()
        new.rows = [self._queue.popleft() for _ in range(n)]
        if self.kv_layers:       # (rows of one kind: all fresh, or all from a prompt-cache hit)
            same = [r.req.caches is None for r in new.rows]
            cut = next((i for i, s in enumerate(same) if s != same[0]), len(same))
            for r in reversed(new.rows[cut:]):
                self._queue.appendleft(r)
            new.rows = new.rows[:cut]
        per_row = [r.req.caches if r.req.caches is not None else self.model.make_cache()
                   for r in new.rows]
        if self.deterministic:
            per_row = [temporal_caches(c) for c in per_row]
        new.caches = batch_caches_q(per_row) if self.kv_layers else batch_caches(per_row)
        self._prefill.extend(new)

    def _graduate(self, idx: List[int]) -> List[RowEvent]:
        g = self._prefill.take(idx)
        for i, r in enumerate(g.rows):     # (a snapshot of the prompt but its last token)
            if r.req.on_prefilled is not None and r.at:
                r.req.on_prefilled(extract_row(g.caches, i))
        given = [i for i, r in enumerate(g.rows) if r.req.first_logits is not None]
        events = []
        if given:                # (their caches hold the whole prompt: no forward of their own)
            h = g.take(given)
            events = self._to_decode(h, mx.array([r.last for r in h.rows]),
                                     mx.concatenate([r.req.first_logits for r in h.rows]))
            if not g.rows:
                return events
        inputs = mx.array([r.last for r in g.rows])
        kw = embedding_kwargs(self.model, g.rows, [r.at for r in g.rows],
                              [[r.last] for r in g.rows], 1)     # ({}: no row has images)
        logits = self._forward(g, inputs[:, None], **kw)[:, -1, :]
        quantize_group(g.caches, self.kv_layers)
        return events + self._to_decode(g, inputs, logits)

    def _to_decode(self, g: Group, inputs: mx.array, logits: mx.array) -> List[RowEvent]:
        """Graduated rows g join the decode group, sampled from their last prompt token's
        logits [B, V] (inputs: those tokens)."""
        for r in g.rows:
            r.embeds = None
        g.next_tokens, lp = self._sample(g, inputs, logits)
        g.next_logprobs = list(lp)
        mx.async_eval(g.next_tokens, g.next_logprobs)
        for r in g.rows:
            r.tokens.append(r.last)
        early = [(i, r) for i, r in enumerate(g.rows) if self.first_at_graduate
                 and r.error is None and r.req.max_tokens is None and not r.stops
                 and r.text is None and r.spec is None]   # (speculating rows: pipelined)
        events = []
        if early:                # (waits for this forward only; the tokens, values as before)
            toks = g.next_tokens.tolist()
            for i, r in early:
                r.early = True
                events.append(RowEvent(r.uid, toks[i], g.next_logprobs[i]))
        self._decode.extend(g)
        return events

    def _rows_in_budget(self, n: int) -> int:
        """Of the next n queued rows, how many may join the prefill group while its padded
        chunk (rows x the longest next chunk) stays within the budget; one at least when the
        group is empty (whole chunks: a long prompt prefills alone, short ones together)."""
        step = self.prefill_step_size
        rows = len(self._prefill.rows)
        widest = max((min(len(r.pending), step) for r in self._prefill.rows), default=0)
        take = 0
        for r in islice(self._queue, n):       # (not a copy of the whole queue a step)
            w = max(widest, min(len(r.pending), step), 1)
            if rows + take and (rows + take + 1) * w > self.prefill_budget:
                break
            widest, take = w, take + 1
        return take

    def _chunk_size(self, rows: int) -> int:
        """Prompt tokens per row in this prefill step: `prefill_step_size`, or with a budget,
        the budget shared by the rows (at least PREFILL_BUCKET each), so a burst of long
        prompts does not hold the decoding rows for rows x step size tokens."""
        if not self.prefill_budget or self.whole_chunks:
            return self.prefill_step_size
        return min(self.prefill_step_size, max(PREFILL_BUCKET, self.prefill_budget // rows))

    def _prefill_chunk(self):
        g = self._prefill
        chunks, starts = [], []
        size = self._chunk_size(len(g.rows))
        for r in g.rows:
            chunks.append(r.pending[:size])
            r.pending = r.pending[size:]
            r.tokens.extend(chunks[-1])
            starts.append(r.at)
            r.at += len(chunks[-1])
        lengths = [len(c) for c in chunks]
        T = max(lengths)
        if self.prefill_bucket:
            T = max(T, min(-(-T // self.prefill_bucket) * self.prefill_bucket,
                           self.prefill_step_size))
        pads = [T - n for n in lengths]
        padded = max(pads) > 0
        if padded:
            for c in g.caches:
                c.prepare(lengths=lengths, right_padding=pads)
            tokens = mx.array([c + [0] * p for c, p in zip(chunks, pads)])
        else:
            tokens = mx.array(chunks)
        self._forward(g, tokens,       # ({}: no row has images, batch_vision)
                      **embedding_kwargs(self.model, g.rows, starts, chunks, T))
        eval_caches(g.caches)
        if padded:
            for c in g.caches:
                c.finalize()
            eval_caches(g.caches)
        quantize_group(g.caches, self.kv_layers)

    def retire(self, uids, unused: Optional[dict] = None) -> dict:
        """End decoding rows now (their caller's update decided they finished: the Engine's
        EOS, length and stop-string checks); uid -> the row's single-row caches (rows that
        asked for them, `return_cache`) or None. One filter of the decode group for all of
        them, where a row ending in `_decode_step` would have been dropped. unused: uid ->
        tokens of the last step the caller did not take (after a stop inside an accepted
        draft run): trimmed from that row's caches."""
        g = self._decode
        want, unused = set(uids), unused or {}
        out, keep = {}, []
        for i, r in enumerate(g.rows):
            if r.uid in want:
                out[r.uid] = extract_row(g.caches, i) if r.req.return_cache else None
                for c in out[r.uid] if out[r.uid] and unused.get(r.uid) else ():
                    c.trim(unused[r.uid])
                r.retired = r.early     # (an early row runs in the next forward: kept)
            if r.retired or r.uid not in want:
                keep.append(i)
        if all(g.rows[i].retired for i in keep):
            keep = []                   # (no other row's forward to run it in)
        if len(keep) < len(g):
            g.filter(keep)
        return out

    # -- prompt-cache hand-off ------------------------------------------------------
    def row_caches(self, uid: int) -> Optional[list]:
        """A decoding or prefilling row's KV as single-row caches (for a prompt cache)."""
        for g in (self._decode, self._prefill):
            for i, r in enumerate(g.rows):
                if r.uid == uid:
                    return extract_row(g.caches, i)
        return None


def batch_generate(model, prompts: Sequence[Sequence[int]], *, max_tokens=64, **kw):
    """All prompts at once; returns per prompt (tokens, [logprobs [V]], finish_reason)."""
    sched = BatchScheduler(model, **kw)
    uids = [sched.submit(BatchRequest(list(p), max_tokens=max_tokens)) for p in prompts]
    out = {u: ([], [], None) for u in uids}
    for ev in sched.run():
        toks, lps, _ = out[ev.uid]
        if ev.token is not None:
            toks.append(ev.token)
            lps.append(ev.logprobs)
        out[ev.uid] = (toks, lps, ev.finish_reason)
    return [out[u] for u in uids]
