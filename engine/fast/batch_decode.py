"""L3 decode step for the rows of the continuous batch (opt-in: the `fast_batch` lever).

`FastBatchDecoder(model, levers)` replaces the model's forward for the batch's decode
steps only (prefill, admission and a row's first step stay on the L1 path). It works on
the scheduler's own `engine.kv.batch_cache.BatchKVCache` objects, one per layer:

- every row is right-aligned in a buffer [B, Hkv, capacity, D] and all rows write the
  next token at one shared column (`write_column`, held in a device scalar);
- row b's RoPE position is its own `offset[b]` (an int32 device array [B]) and its
  keys start at its `left_padding[b]`: attention covers columns
  [left_padding[b], write_column] (`kernels.decode_attention(start=)`);
- the buffers have a capacity in multiples of CAPACITY_STEP columns (`reserve`), so
  one compiled step serves many tokens.

With `compiled_decode` the step is traced once per (rows, capacity) with `mx.compile`;
rows joining or leaving and buffer growth change the shape, so up to MAX_TRACES traces
are kept (least recently used dropped first) and reused when a shape comes back.

After a step the caches are still valid BatchKVCache objects (`advance`), so
filter / extend / extract and later L1 steps (a row's first step, prefill of joining
rows) go on working on them.

Covered: what `engine.fast.decode.why_not` covers (llama and qwen3 with full attention,
float KV, one process), and only `BatchKVCache` layers; anything else stays on L1,
and `stats.fallback_reason` says why.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from engine.kv.batch_cache import BatchKVCache
from ..levers import Levers
from . import kernels as K
from . import mega as MG
from .decode import CAPACITY_STEP, as_int32, own_contiguous, why_not
from .merge import module_version
from .step import KernelChoice, cached_attention, gemv_ok, gemv_stack, layer_stack, rotated_qkv

MAX_TRACES = 16


@dataclass
class FastBatchStats:
    traces: int = 0          # compiled steps built (one per (rows, capacity) seen)
    traces_kept: int = 0     # of them, still held (at most MAX_TRACES)
    steps: int = 0           # batch decode steps run through the fast path
    row_steps: int = 0       # tokens decoded through it (rows x steps)
    fallbacks: int = 0       # decode steps that went to the L1 forward instead
    fallback_reason: Optional[str] = None   # why, the last time
    kernels: bool = False    # CUDA kernels in use (False: stock-MLX reference ops)
    attn_kernel: bool = False
    gemv: bool = False       # projections through engine.fast.gemv (kernels at <= 8 rows)
    mega: bool = False       # the step as one kernel per group of rows (engine.fast.mega)
    mega_reason: Optional[str] = None   # why not, where it is not used


def capacity_for(need: int) -> int:
    """Buffers come in multiples of CAPACITY_STEP columns, so traces are reused."""
    return (need + CAPACITY_STEP - 1) // CAPACITY_STEP * CAPACITY_STEP


def why_not_caches(caches) -> Optional[str]:
    """None if the batch step can run on these (per-layer) caches, else why not."""
    if not caches:
        return "no caches"
    if any(type(c) is not BatchKVCache for c in caches):
        return "only BatchKVCache layers (full attention, float KV) are supported"
    if any(c.empty() for c in caches):
        return "an empty cache (no prompt processed yet)"
    return None


class FastBatchDecoder:
    """Callable `(tokens [B], caches: list[BatchKVCache]) -> logits [B, V]`: one decode
    step of every row; the caches advance by one column."""

    def __init__(self, model, levers: Levers, max_traces: int = MAX_TRACES):
        reason = why_not(model)
        if reason:
            raise ValueError(reason)
        if max_traces < 1:
            raise ValueError(f"max_traces must be >= 1, got {max_traces}")
        self.model = model
        self.levers = levers
        self.max_traces = max_traces
        kc = KernelChoice.for_model(model, levers)
        self.use_kernels, self.use_attn_kernel, self._inv_freq, self._mega_freq = (
            kc.use_kernels, kc.use_attn_kernel, kc.inv_freq, kc.mega_freq)
        self._add_rms, self._rope_kernel = kc.add_rms, kc.rope_kernel
        self._fns: OrderedDict = OrderedDict()
        self._version = module_version(model)
        self._col: Optional[mx.array] = None
        self._col_host = -1
        self._mega = None
        self._own: list = []       # the buffers the one-kernel step last wrote in place
        self.stats = FastBatchStats(kernels=self.use_kernels, attn_kernel=self.use_attn_kernel)

    # --- the step, as a pure function of (tokens, positions, column, starts, buffers) ----

    def _attention(self, attn, x, pos, col, start, keys, values):
        q, k, v = rotated_qkv(attn, x, pos, self._inv_freq, self._rope_kernel)
        keys = mx.slice_update(keys, k, col, axes=(2,))
        values = mx.slice_update(values, v, col, axes=(2,))
        o = K.decode_attention(q, keys, values, col + 1, attn.scale, self.use_attn_kernel,
                               start=start)
        return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(x.shape[0], 1, -1)), keys, values

    def _forward(self, tokens, pos, col, start, *buffers):
        n = len(self.model.layers)
        ks, vs = list(buffers[:n]), list(buffers[n:])

        def attend(i, attn, x):
            a, ks[i], vs[i] = self._attention(attn, x, pos, col, start, ks[i], vs[i])
            return a
        logits = layer_stack(self.model, tokens, attend, self._add_rms)
        return (logits, pos + 1, col + 1, *ks, *vs)

    def _forward_gemv(self, tokens, pos, col, start, *buffers):
        """The step with every projection through engine.fast.gemv (step.gemv_stack)."""
        n = len(self.model.layers)
        ks, vs = list(buffers[:n]), list(buffers[n:])
        length = col + 1
        attend = cached_attention(ks, vs, col, length, self.use_attn_kernel, start=start)
        logits = gemv_stack(self.model, tokens, attend, pos, self._inv_freq, self.use_kernels,
                            self._rope_kernel)
        return (logits, pos + 1, length, *ks, *vs)

    def _forward_mega(self, tokens, pos, col, start, *buffers):
        """The step as one kernel per group of rows (engine.fast.mega): the buffers are
        written in place and stay the caches."""
        n = len(self.model.layers)
        if self._mega is None:
            self._mega = MG.MegaStep(self.model, self._mega_freq, self.levers.fast)
        logits, _ = self._mega(tokens, pos, col, start, buffers[:n], buffers[n:])
        return logits, pos + 1, col + 1

    def _fn(self, rows: int, capacity: int):
        """(the compiled step for this shape, whether it is the one-kernel step, which
        writes the buffers in place)."""
        # a trace holds the modules as they were (adapters, merged groups) and the fault
        # active when it was built (the negative control): either changing needs a new one
        version = module_version(self.model)
        if version != self._version:
            self._fns.clear()
            self._version = version
            self._mega = None
        key = (rows, capacity, K.active_fault())
        entry = self._fns.get(key)
        if entry is None:
            self.stats.gemv = gemv_ok(self.model, self.levers)
            reason = MG.why_not(self.model, self.levers) if self._mega_freq is not None else "no RoPE kernel"
            if reason is None and rows > MG.rows_per_call(self.model):
                # (several calls a step, each reading every weight: measured slower on the
                # H200 at 32 rows than the step of separate kernels: reports/l3/JOURNAL.md)
                reason = f"more rows than one kernel call takes ({MG.rows_per_call(self.model)})"
            self.stats.mega, self.stats.mega_reason = reason is None, reason
            fwd = (self._forward_mega if self.stats.mega
                   else self._forward_gemv if self.stats.gemv else self._forward)
            entry = (mx.compile(fwd) if self.levers.compiled_decode else fwd, self.stats.mega)
            self._fns[key] = entry
            self.stats.traces += 1
            while len(self._fns) > self.max_traces:
                self._fns.popitem(last=False)
        else:
            self._fns.move_to_end(key)
        self.stats.traces_kept = len(self._fns)
        return entry

    @property
    def trace_keys(self) -> list:
        """(rows, capacity, fault) of the traces held, least recently used first."""
        return list(self._fns)

    # --- the public step -------------------------------------------------------------

    def covers(self, caches) -> bool:
        """Whether this step can run on `caches`; if not, the reason is counted in stats."""
        reason = why_not_caches(caches)
        if reason is None and len(caches) != len(self.model.layers):
            reason = f"{len(caches)} caches for {len(self.model.layers)} layers"
        if reason is not None:
            self.stats.fallbacks += 1
            self.stats.fallback_reason = reason
            return False
        return True

    def __call__(self, tokens: mx.array, caches) -> mx.array:
        """Logits [B, V] for one new token per row; every cache advances one column."""
        c0 = caches[0]
        col = c0.write_column
        cap = c0.capacity
        if cap < col + 1 or cap % CAPACITY_STEP:
            cap = capacity_for(col + 1)
        for c in caches:
            if c.capacity != cap:
                c.reserve(cap)
        if self._col is None or self._col_host != col:
            self._col = mx.array([col], dtype=mx.int32)
        B = c0.batch_size
        n = len(caches)
        fn, in_place = self._fn(B, cap)
        if in_place:                         # (the one-kernel step: contiguous buffers of our own)
            self._own = own_contiguous(caches, self._own)
        out = fn(as_int32(tokens).reshape(-1), c0.offset, self._col,
                 c0.left_padding, *[c.keys for c in caches], *[c.values for c in caches])
        logits, pos, self._col = out[0], out[1], out[2]
        for i, c in enumerate(caches):
            if in_place:
                c.advance(c.keys, c.values, pos)
            else:
                c.advance(out[3 + i], out[3 + n + i], pos)
        self._col_host = col + 1
        self.stats.steps += 1
        self.stats.row_steps += B
        return logits
