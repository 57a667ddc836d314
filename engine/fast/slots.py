"""The fast runner's KV: the decoding rows of the batch, each in a slot of its own.

`SlotPool(step, model)` holds per layer keys and values [S, Hkv, C, D]. A row joining the
batch (after its prompt was prefilled on the L1 path and its first token sampled) is copied
once into the lowest free slot, its tokens at columns [0, n); it then writes each new token
at its own column n (`engine.fast.decode.FastStep`: one position a row). A row leaving frees
its slot; nobody's KV moves. So rows join and leave between any two steps without a copy of
the others' KV and without a new shape:

- S, the rows the step runs, is a bucket (`FastStep.rows_for`: a power of two, capped at the
  one-kernel step's rows a call while they fit one) just above the highest slot in use; free slots
  inside it run as idle rows (token 0 at column 0 of their own slot, their logits never
  read);
- C, the columns, is 512 times a power of two, above the longest row's next column;
- S and C grow when a row needs it and shrink (with slack, so a boundary does not flip
  back and forth) when rows leave: the buffers are copied then, and the step for the new
  shape is traced once (`FastStep` keeps its traces: a shape seen before is not traced
  again).

The pool stands where the batch scheduler's decode group keeps its per-layer caches
(`engine.step.batch`): `extend` (graduating rows' `BatchKVCache` layers), `filter(keep)`,
`rewind(drop)` (rejected drafts: engine.step.fast_draft, engine.step.batch_lookup),
`verify(tokens, lengths)` (a speculating step: each row's token and drafts, engine.step.batch_lookup), `extract(i)`
(a row's KV as single-row `KVCache` layers, for the prompt cache; `replace(i, ...)` puts such
layers back), `nbytes`,
and `__call__(tokens [B]) -> logits [B, V]` for the decode step, rows in the group's order.
"""

from __future__ import annotations

from itertools import accumulate
from typing import List, Optional

import mlx.core as mx

from engine.kv.batch_cache import batch_caches
from engine.kv.cache import KVCache
from .decode import CAPACITY_STEP, FastStep, capacity_for


class SlotPool:
    def __init__(self, step: FastStep, model):
        a0 = model.layers[0].self_attn
        self.step = step
        self.n_layers = len(model.layers)
        self.kv_heads, self.head_dim = a0.n_kv_heads, a0.head_dim
        self.dtype = model.layers[0].input_layernorm.weight.dtype
        self.keys: Optional[List[mx.array]] = None
        self.values: Optional[List[mx.array]] = None
        self.slots: List[int] = []        # the group's row i -> its slot
        self.held: List[int] = []         # per slot: tokens in its KV (-1: free)
        self._dev = None                  # (pos [S], active [S], take [B] or None, put [S] or None)
        self.reallocs = 0                 # buffers copied to a new shape (growth or shrink)

    @classmethod
    def of_prompts(cls, step: FastStep, model, prompts: List[list]) -> "SlotPool":
        """A pool holding each prompt's KV (the model's own forward over it), a row each, in
        order (identical prompts prefilled once): the verify experiments', the L3 gate's and
        the warm-up's pools."""
        pool, done = cls(step, model), {}
        for p in prompts:
            if tuple(p) not in done:
                caches = model.make_cache()
                mx.eval(model(mx.array(p)[None], cache=caches))
                done[tuple(p)] = batch_caches([caches])
            pool.extend(done[tuple(p)])
        return pool

    # --- shape ---------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.held)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _resize(self, rows: int, capacity: int) -> None:
        """New buffers [rows, Hkv, capacity, D]; the slots below `rows` keep their KV."""
        old_k, old_v, old_rows = self.keys, self.values, self.rows
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        keep_r = min(rows, old_rows)
        keep_c = min(capacity, self.capacity)
        ks, vs = [], []
        for i in range(self.n_layers):
            k, v = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
            if old_k is not None and keep_r and keep_c:
                k[:keep_r, :, :keep_c] = old_k[i][:keep_r, :, :keep_c]
                v[:keep_r, :, :keep_c] = old_v[i][:keep_r, :, :keep_c]
            ks.append(k)
            vs.append(v)
        self.keys, self.values = ks, vs
        self.held = self.held[:rows] + [-1] * (rows - len(self.held))
        mx.eval(ks, vs)
        self.reallocs += old_k is not None
        self._dev = None

    def _fit(self, need_rows: int, need_cols: int) -> None:
        """Grow to hold `need_rows` slots and `need_cols` columns; shrink where the
        buffers are at least four times (columns) or twice (rows) what is needed."""
        rows, cap = self.rows, self.capacity
        want_r = self.step.rows_for(max(need_rows, 1))
        want_c = capacity_for(max(need_cols, 1))
        new_r = want_r if (want_r > rows or want_r * 2 <= rows) else rows
        new_c = want_c if (want_c > cap or (cap > CAPACITY_STEP and want_c * 4 <= cap)) else cap
        if (new_r, new_c) != (rows, cap):
            self._resize(new_r, new_c)

    def _used_extent(self) -> tuple:
        """(slots needed: highest slot in use + 1, columns needed: longest next column + 1)."""
        used = [s for s, n in enumerate(self.held) if n >= 0]
        return (max(used) + 1 if used else 0,
                max((self.held[s] for s in used), default=0) + 1)

    # --- the decode group's interface ----------------------------------------------------

    def extend(self, caches: list) -> "SlotPool":
        """Take in the rows of `caches` (one `BatchKVCache` per layer, e.g. rows that just
        left the prefill group), each into the lowest free slot, after the rows held."""
        B = caches[0].batch_size
        for j in range(B):
            rows = [c.extract(j) for c in caches]
            free = [s for s, h in enumerate(self.held) if h < 0]
            slot = free[0] if free else self.rows
            self._put(slot, rows)
            self.slots.append(slot)
        self._dev = None
        return self

    def _put(self, slot: int, rows: list) -> None:
        """Slot `slot` holds `rows` (single-row `KVCache` layers, tokens from column 0)."""
        n = rows[0].offset
        rows_needed, cols = self._used_extent()
        self._fit(max(rows_needed, slot + 1), max(cols, n + 1))
        for i, r in enumerate(rows):
            self.keys[i][slot:slot + 1, :, :n] = r.keys[:, :, :n]
            self.values[i][slot:slot + 1, :, :n] = r.values[:, :, :n]
        self.held[slot] = n

    def replace(self, i: int, rows: list) -> None:
        """Row i's KV becomes `rows`' (single-row `KVCache` layers from column 0: `extract(i)`
        after more of the row's tokens went through the model)."""
        self._put(self.slots[i], rows)
        self._dev = None

    def filter(self, keep: List[int]) -> None:
        """Keep the group's rows `keep` (in that order); the others' slots are freed."""
        kept = [self.slots[i] for i in keep]
        for s in set(self.slots) - set(kept):
            self.held[s] = -1
        self.slots = kept
        self._dev = None
        self._fit(*self._used_extent())

    def rewind(self, drop: List[int]) -> None:
        """The last drop[i] tokens leave row i's KV (their columns are written over next)."""
        for slot, d in zip(self.slots, drop):
            if d:
                self.held[slot] -= d
        self._dev = None

    def verify(self, tokens: mx.array, lengths: List[int]) -> mx.array:
        """A verify step (engine.step.batch_lookup): row i's first lengths[i] tokens of `tokens`
        [B, T] (its current token, then its drafts) go through the model at its next lengths[i]
        columns, every row's in one fast step whose call rows each name their slot
        (`FastStep(..., crow=)`), a row's later positions attending to its earlier ones.
        Returns logits [B, T, V]: row i's position j after its tokens up to j (from lengths[i]
        on, its last position's again). Each row then holds T more tokens (the ones past
        lengths[i] never written): `rewind` takes back the ones not kept, at least T - lengths[i]."""
        B, T = tokens.shape
        starts = [self.held[s] for s in self.slots]
        calls = [(i, j) for i, n in enumerate(lengths) for j in range(n)]
        n_calls = len(calls)
        calls += [calls[-1]] * (self.step.verify_rows_for(n_calls) - n_calls)   # (padding: the last
        need = max(h + T for h in starts)                                # call again, same write)
        if need > self.capacity:
            self._fit(self.rows, need)
        toks = tokens.reshape(-1)[mx.array([i * T + j for i, j in calls], dtype=mx.int32)]
        pos = mx.array([starts[i] + j for i, j in calls], dtype=mx.int32)
        crow = mx.array([self.slots[i] for i, _ in calls], dtype=mx.int32)
        logits, _, self.keys, self.values = self.step(toks, pos, mx.ones(pos.shape, mx.int32),
                                                      self.keys, self.values, crow=crow)
        first = list(accumulate(lengths, initial=0))      # (row i's first call row)
        back = [first[i] + min(j, lengths[i] - 1) for i in range(B) for j in range(T)]
        for s in self.slots:
            self.held[s] += T
        self._dev = None
        return logits[mx.array(back, dtype=mx.int32)].reshape(B, T, -1)

    def extract(self, i: int) -> list:
        """Row i's KV as single-row `KVCache` layers (its tokens only)."""
        s = self.slots[i]
        n = self.held[s]
        out = []
        for k, v in zip(self.keys, self.values):
            c = KVCache()
            c.keys = mx.contiguous(k[s:s + 1, :, :n])
            c.values = mx.contiguous(v[s:s + 1, :, :n])
            c.offset = n
            out.append(c)
        return out

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def _device_state(self):
        if self._dev is None:
            S = self.rows
            pos = [max(h, 0) for h in self.held]
            active = [int(h >= 0) for h in self.held]
            if self.slots == list(range(S)):
                take = put = None             # (rows in slot order, every slot in use)
            else:
                take = mx.array(self.slots, dtype=mx.int32)
                where = {s: i for i, s in enumerate(self.slots)}
                put = mx.array([where.get(s, len(self.slots)) for s in range(S)], dtype=mx.int32)
            self._dev = [mx.array(pos, dtype=mx.int32), mx.array(active, dtype=mx.int32), take, put]
        return self._dev

    def __call__(self, tokens: mx.array) -> mx.array:
        """One decode step of every row (tokens [B], the group's order): logits [B, V]."""
        _, cols = self._used_extent()
        if cols > self.capacity:
            self._fit(self.rows, cols)
        dev = self._device_state()
        pos, active, take, put = dev
        toks = tokens.reshape(-1)
        if put is not None:            # slot s gets row put[s]'s token (idle slots: 0)
            toks = mx.concatenate([toks, mx.zeros((1,), dtype=toks.dtype)])[put]
        logits, dev[0], self.keys, self.values = self.step(toks, pos, active, self.keys,
                                                           self.values)
        for s in self.slots:
            self.held[s] += 1
        return logits if take is None else logits[take]
