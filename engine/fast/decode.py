"""The fast runner's decode step (L3): one token for each of 1..N rows over preallocated KV.

`FastStep(model, levers)` is the one step every fast decode runs, the batch's rows
(`engine.fast.slots.SlotPool`) and a request decoding alone (`FastDecoder`, the exact
runner's decode with a fast lever on):

    (tokens [B], pos [B], active [B], keys, values) -> (logits [B, V], pos + active, keys, values)

Row b's token is at RoPE position pos[b]; its key and value are written at column pos[b] of
row b of each layer's buffer [B, Hkv, capacity, D] and it attends over columns [0, pos[b]]:
every row sits in a row of the buffers of its own, from column 0, so rows join and leave
without moving anyone's KV. Prefill stays on the L1 path (prompt processing and its logits
are L1's). Each step

- writes the new K/V at each row's own column,
- attends over each row's filled part (`kernels.decode_attention`, one length a row),
- folds every residual add into the next RMSNorm and rotates q/k out of the merged q/k/v
  projection (`kernels`, `engine.fast.gemv`), or on an NVIDIA GPU runs as one kernel
  (`engine.fast.mega`, up to `mega.rows_per_call` rows) that writes the KV in place,

and with `compiled_decode` is traced once per (rows, capacity) with `mx.compile` (at most
MAX_TRACES kept, least recently used dropped): the caller picks fixed shapes (row buckets,
capacities of CAPACITY_STEP times a power of two) so a trace serves every later step of that
shape, and a server's shapes all stay held.
`stats.traces` counts the traces actually made (the step's Python body runs only while
`mx.compile` traces it), so a test can prove serving does not retrace.

Supported: the llama and qwen3 families with full attention and float KV. `why_not(model,
...)` says why another model stays on the L1 path.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import models as _models  # noqa: F401  (engine.kv.cache needs the models package first)
from engine.kv.cache import KVCache
from ..levers import Levers
from . import kernels as K
from . import mega as MG
from .merge import module_version
from ..adapters.mount import active_adapters
from .step import KernelChoice, cached_attention, gemv_ok, gemv_stack, layer_stack, rotated_qkv

SUPPORTED_TYPES = ("llama", "qwen3")
CAPACITY_STEP = 512
# traces kept: a server's shapes all stay held — per capacity in use (512 x 2^k columns) its
# rows buckets (7 up to 64 rows) and, where rows speculate, its verify steps' (call rows,
# slots) buckets (39 for 32 rows drafting 4 tokens: engine.step.warmup.verify_shapes)
MAX_TRACES = 256


def capacity_for(need: int) -> int:
    """Buffers come in CAPACITY_STEP times a power of two columns (512, 1024, 2048, ...), so a
    server sees few shapes and keeps a trace for each (at most 2x the columns needed: the
    attention reads only each row's filled ones)."""
    cap = CAPACITY_STEP
    while cap < need:
        cap *= 2
    return cap


def own_contiguous(arrays: list, own: list) -> list:
    """Before a step that writes buffers in place (engine.fast.mega): every array of
    `arrays` not among `own` (the ones that step used last time) becomes a row-contiguous
    array of its own (`mx.contiguous`; the kernel would otherwise get a copy and the write
    would be lost). Returns the arrays to use (and keep as the new `own`)."""
    return [a if (j < len(own) and own[j] is a) else mx.contiguous(a)
            for j, a in enumerate(arrays)]


def as_int32(tokens: mx.array) -> mx.array:
    """Token ids as int32: the sampler's uint32 ids reinterpreted in place (ids are below
    2^31; no copy operation a step), other dtypes converted."""
    if tokens.dtype == mx.int32:
        return tokens
    return mx.view(tokens, mx.int32) if tokens.dtype == mx.uint32 else tokens.astype(mx.int32)


def _signature(fwd, verify: bool):
    """The step's compiled signature: (tokens, pos, active, *buffers), or for a verify step
    (tokens, pos, active, crow, *buffers); `fwd` takes (tokens, pos, active, crow, buffers)."""
    if verify:
        return lambda tokens, pos, active, crow, *buffers: fwd(tokens, pos, active, crow, buffers)
    return lambda tokens, pos, active, *buffers: fwd(tokens, pos, active, None, buffers)


def why_not(model, caches=None, policy=None, batch: int = 1) -> Optional[str]:
    """None if the fast step can run this model/caches, else the reason it cannot."""
    if getattr(model, "model_type", None) not in SUPPORTED_TYPES:
        return f"model_type {getattr(model, 'model_type', None)!r} has no fast decode step"
    args = model.args
    if any(t != "full_attention" for t in args.layer_types):
        return "sliding-window layers are not supported by the fast step"
    if any("Sharded" in type(getattr(layer.self_attn, "o_proj", None)).__name__
           for layer in model.layers):
        return "tensor-parallel (sharded) models stay on the L1 path"
    if policy is not None and getattr(policy, "active", False):
        return "quantized KV stays on the L1 path"
    if caches is not None and any(type(c) is not KVCache for c in caches):
        return "only plain float KV caches are supported"
    if any(type(getattr(layer.self_attn, "rope", None)).__name__ not in ("RoPE", "FreqRoPE")
           for layer in model.layers):
        return "unsupported RoPE module"
    return None


# A 4-bit model whose layers hold more than this (packed weights, scales, biases) decodes one
# row faster on the step of separate kernels with the 4-bit tensor-core kernel (engine.fast.qmm)
# than on the one kernel: there the weight read dominates, and qmm reads faster (H100, 8B, ~117
# MiB a layer: 256 tok/s against 202 at 0.5.2; 247 against 227 with the one kernel's 4-bit dot
# on the tensor cores, 0.5.8). Below it the separate step is bound by its launches (1B, ~33 MiB
# a layer: 1,208 tok/s on the one kernel against 648, H100, 0.5.8; the 1B step of separate
# kernels took 1.7 ms with its kernels emptied, H200). reports/l3/JOURNAL.md, 0.5.2 and 0.5.8.
QMM_ONE_ROW_LAYER_BYTES = 80 * 2**20


def layer_bytes(model) -> int:
    """Bytes of the first decoder layer's arrays (its weights; quantized: packed, scales, biases)."""
    return sum(v.nbytes for _, v in tree_flatten(model.layers[0].parameters()))


def one_kernel_rows(model, levers) -> tuple:
    """(rows one call of the one kernel takes, why none where a 4-bit model leaves it): 0 where
    it is not used (`mega.why_not` says why). A 4-bit model whose projections all take qmm
    (`step.gemv_ok`): one row at most (the one kernel's multi-row 4-bit calls were ~3x slower
    than qmm's), and none where a layer holds more than QMM_ONE_ROW_LAYER_BYTES."""
    if MG.why_not(model, levers) is not None:
        return 0, None
    q = MG.quantization(model)
    if q is None or q[0] != 4 or not gemv_ok(model, levers):
        return MG.rows_per_call(model), None
    if layer_bytes(model) > QMM_ONE_ROW_LAYER_BYTES:
        return 0, "4-bit layers this large decode faster on the separate kernels with qmm"
    return 1, None


@dataclass
class FastStats:
    traces: int = 0        # traces made (the step's body run by mx.compile): new shapes only
    traces_kept: int = 0   # compiled steps held (at most MAX_TRACES)
    steps: int = 0         # decode steps run through the fast step
    verify_steps: int = 0  # of them, verify steps (rows of a call sharing buffer rows: crow)
    row_steps: int = 0     # rows x steps (inactive rows of a bucket included)
    kernels: bool = False  # CUDA kernels in use (False: stock-MLX reference ops)
    attn_kernel: bool = False
    gemv: bool = False     # projections through engine.fast.gemv (norm / residual / SiLU fused)
    mega: bool = False     # the last shape built runs as one kernel (engine.fast.mega)
    mega_reason: Optional[str] = None   # why not, where it is not used


class FastStep:
    """The fast decode step for B rows (see the module's docstring). One per (model,
    levers), kept on the model by `engine.fast.apply`, so its traces serve every request."""

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
        self._mega = None
        self._mega_ws = None
        self._own: list = []      # the buffers the one-kernel step last wrote in place
        self._zeros: dict = {}    # rows -> (int32 zeros [rows]: their first column, arange: their cache rows)
        self.stats = FastStats(kernels=self.use_kernels, attn_kernel=self.use_attn_kernel)
        # rows one call of the one-kernel step takes (0: that step is not used)
        self.mega_rows, self.mega_off = (one_kernel_rows(model, levers) if self._mega_freq is not None
                                         else (0, None))

    def rows_for(self, n: int) -> int:
        """The rows a step runs for n rows in use (a bucket, so shapes repeat): a power of
        two, but at most what one call of the one-kernel step takes while n fits one call
        (e.g. 7 for an 8B model, whose 5 to 7 rows then stay on the one kernel)."""
        b = 1
        while b < n:
            b *= 2
        R = self.mega_rows
        return min(b, R) if R and n <= R else b

    def verify_rows_for(self, n: int) -> int:
        """The call rows a verify step runs for n call rows: n itself while one call of the
        one-kernel step takes them (its cost grows with its rows: a bucket of 8 for 5 rows paid
        for 3 more), else `rows_for(n)`."""
        R = self.mega_rows
        return n if R and n <= R else self.rows_for(n)

    # --- the step, as a pure function of (tokens, positions, active, buffers) -----------

    def _traced(self):
        if self.levers.compiled_decode:    # (the body runs only while mx.compile traces it)
            self.stats.traces += 1

    def _forward(self, tokens, pos, active, crow, buffers):
        """The model's own projections with the fused add + RMSNorm and RoPE steps."""
        self._traced()
        n = len(self.model.layers)
        ks, vs = list(buffers[:n]), list(buffers[n:])
        length = pos + 1
        attend_qkv = cached_attention(ks, vs, pos, length, self.use_attn_kernel, crow=crow)

        def attend(i, attn, x):
            q, k, v = rotated_qkv(attn, x, pos, self._inv_freq, self._rope_kernel)
            return attn.o_proj(attend_qkv(i, attn, q, k, v))
        logits = layer_stack(self.model, tokens, attend, self._add_rms)
        return (logits, pos + active, *ks, *vs)

    def _forward_gemv(self, tokens, pos, active, crow, buffers):
        """Every projection through engine.fast.gemv (step.gemv_stack)."""
        self._traced()
        n = len(self.model.layers)
        ks, vs = list(buffers[:n]), list(buffers[n:])
        attend = cached_attention(ks, vs, pos, pos + 1, self.use_attn_kernel, crow=crow)
        logits = gemv_stack(self.model, tokens, attend, pos, self._inv_freq, self.use_kernels,
                            self._rope_kernel)
        return (logits, pos + active, *ks, *vs)

    def _forward_mega(self, tokens, pos, active, crow, buffers):
        """The step as one kernel per group of rows (engine.fast.mega): the buffers are
        written in place and stay the KV."""
        self._traced()
        n = len(self.model.layers)
        if self._mega is None:
            self._mega = MG.MegaStep(self.model, self._mega_freq, self.levers.fast)
        B = tokens.size
        zeros = self._zeros.get(B)
        if zeros is None:      # (row b's first column, and its cache row where crow is None)
            zeros = self._zeros[B] = (mx.zeros((B,), dtype=mx.int32), mx.arange(B, dtype=mx.int32))
        logits, wss = self._mega(tokens, pos, pos, zeros[0], zeros[1] if crow is None else crow,
                                 buffers[:n], buffers[n:])
        # the workspace holds the phase timer's stamps with MLXP_MEGA_PROF=1
        return (logits, pos + active, wss[0]) if self._mega.prof else (logits, pos + active)

    def _fn(self, rows: int, capacity: int, slots: Optional[int] = None):
        """(the compiled step for this shape, whether it is the one-kernel step, which writes
        the buffers in place). slots: the buffers' rows for a verify step (rows of the call
        each naming its buffer row, `crow`), None for a decode step (row b in buffer row b)."""
        # a trace holds the modules as they were (adapters mounted, merged groups: the
        # version), the adapters switched on and the fault active when it was built (the
        # negative control): a change of version drops the traces, the others are keys
        version = module_version(self.model)
        if version != self._version:
            self._fns.clear()
            self._version, self._mega = version, None
        key = (rows, capacity, K.active_fault(), active_adapters(self.model), slots)
        entry = self._fns.get(key)
        if entry is None:
            self.stats.gemv = gemv_ok(self.model, self.levers)
            reason = (MG.why_not(self.model, self.levers) if self._mega_freq is not None
                      else "no RoPE kernel") or self.mega_off
            # (rows a call: only where the one kernel takes the model, whose parts it reads)
            limit = (self.mega_rows or MG.rows_per_call(self.model)) if reason is None else 0
            if reason is None and rows > limit:
                # (several calls a step, each reading every weight: measured slower on the
                # H200 at 32 rows than the step of separate kernels, and for 4-bit 8B rows on
                # an H100 no faster than MLX's quantized matmul: reports/l3/JOURNAL.md)
                reason = f"more rows than one kernel call takes ({limit})"
            self.stats.mega, self.stats.mega_reason = reason is None, reason
            fwd = (self._forward_mega if self.stats.mega
                   else self._forward_gemv if self.stats.gemv else self._forward)
            fwd = _signature(fwd, slots is not None)
            entry = (mx.compile(fwd) if self.levers.compiled_decode else fwd, self.stats.mega)
            self._fns[key] = entry
            while len(self._fns) > self.max_traces:
                self._fns.popitem(last=False)
        else:
            self._fns.move_to_end(key)
        self.stats.traces_kept = len(self._fns)
        return entry

    @property
    def trace_keys(self) -> list:
        """(rows, capacity, fault, adapters on, buffer rows of a verify step or None) of the
        compiled steps held, least recently used first."""
        return list(self._fns)

    def __call__(self, tokens: mx.array, pos: mx.array, active: mx.array, keys: list,
                 values: list, crow: Optional[mx.array] = None):
        """One step: (logits [B, V], the next positions, keys, values) — the buffers to keep
        (the same arrays when the step wrote them in place). With `crow` (int32 [B]) row b of
        the call is in buffer row crow[b] (buffers [S, ...], any S): a verify, whose rows of one
        slot sit at consecutive positions, each attending to the ones before it."""
        S, cap = keys[0].shape[0], keys[0].shape[2]
        B = tokens.size
        n = len(keys)
        fn, in_place = self._fn(B, cap, None if crow is None else S)
        if in_place:                         # (the one-kernel step: contiguous buffers of our own)
            self._own = own_contiguous(list(keys) + list(values), self._own)
            keys, values = self._own[:n], self._own[n:]
        lead = (as_int32(tokens).reshape(-1), pos, active) + (() if crow is None else (crow,))
        out = fn(*lead, *keys, *values)
        self.stats.steps += 1
        self.stats.verify_steps += crow is not None
        self.stats.row_steps += B
        if in_place:
            self._mega_ws = out[2] if len(out) > 2 else None
            return out[0], out[1], keys, values
        return out[0], out[1], list(out[2:2 + n]), list(out[2 + n:])

    def mega_profile(self) -> dict:
        """The one-kernel step's phase times of the last step (MLXP_MEGA_PROF=1), else {}."""
        if self._mega is None or self._mega_ws is None:
            return {}
        return self._mega.profile(self._mega_ws)

    def mega_block_arrivals(self) -> dict:
        """The last step's per-block phase arrivals (MLXP_MEGA_PROF=1), else {}."""
        if self._mega is None or self._mega_ws is None:
            return {}
        return self._mega.block_arrivals(self._mega_ws)


class FastDecoder:
    """`(tokens [1], caches) -> logits [1, V]`: the fast step for one request's own
    `KVCache` layers (the exact runner's decode with a fast lever on: requests that run
    alone, e.g. with adapters). The caches get a buffer of `capacity_for` columns (the
    filled part copied in once) and stay `KVCache` objects (buffer + offset), so the prompt
    cache and any later L1 step can continue from them."""

    def __init__(self, step: FastStep):
        self.step = step
        self.stats = step.stats
        self._pos: Optional[mx.array] = None
        self._pos_host = -1
        self._one = mx.ones((1,), dtype=mx.int32)

    def reserve(self, caches, extra: int) -> None:
        """Give every cache a buffer with room for `extra` more tokens (copying once)."""
        off = caches[0].offset
        cap = capacity_for(off + extra)
        model = self.step.model
        for c in caches:
            have = c.keys.shape[2] if c.keys is not None else 0
            if have >= off + extra and have == capacity_for(have):
                continue
            a0 = model.layers[0].self_attn
            dtype = (c.keys.dtype if c.keys is not None
                     else model.layers[0].input_layernorm.weight.dtype)
            kb = mx.zeros((1, a0.n_kv_heads, cap, a0.head_dim), dtype)
            vb = mx.zeros((1, a0.n_kv_heads, cap, a0.head_dim), dtype)
            if off:
                kb[..., :off, :] = c.keys[..., :off, :]
                vb[..., :off, :] = c.values[..., :off, :]
            c.keys, c.values = kb, vb
        mx.eval([c.state for c in caches])

    def __call__(self, tokens: mx.array, caches) -> mx.array:
        off = caches[0].offset
        if caches[0].keys is None or off + 1 > caches[0].keys.shape[2]:
            self.reserve(caches, CAPACITY_STEP)
        if self._pos is None or self._pos_host != off:
            self._pos = mx.array([off], dtype=mx.int32)
        logits, self._pos, ks, vs = self.step(tokens, self._pos, self._one,
                                              [c.keys for c in caches],
                                              [c.values for c in caches])
        for c, k, v in zip(caches, ks, vs):
            c.keys, c.values = k, v
            c.offset += 1
        self._pos_host = off + 1
        return logits

    def mega_profile(self) -> dict:
        return self.step.mega_profile()

    def mega_block_arrivals(self) -> dict:
        return self.step.mega_block_arrivals()
