"""L3 decode step: one token per row over a preallocated cache, traced once.

`FastDecoder(model, levers)` replaces the model's forward for decode steps only
(prefill stays on the L1 path, so prompt processing and its logits are exactly
L1's). Before the first decode step the layer caches get a buffer of fixed
capacity (the filled part copied in once); each step then

- writes the new K/V at the position held in a device scalar (`mx.slice_update`),
- attends over the filled part of the buffer (`kernels.decode_attention`),
- folds every residual add into the next RMSNorm (`kernels.add_rms_norm`),
- rotates q/k straight out of the merged q/k/v projection (`kernels.rope_qkv`),

and with `compiled_decode` the whole step is traced once per capacity
(`mx.compile`): no per-token graph building in Python, the position never leaves
the device. Shapes are fixed, so a trace is reused until the capacity grows.

The caches stay `engine.kv.cache.KVCache` objects (buffer + offset), so the prompt
cache and any later L1 request can continue from them.

Supported: the llama and qwen3 families with full attention and float KV.
`why_not(model, ...)` says why another model stays on the L1 path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .. import models as _models  # noqa: F401  (engine.kv.cache needs the models package first)
from engine.kv.cache import KVCache
from ..levers import Levers
from . import kernels as K
from . import mega as MG
from .merge import module_version
from .step import KernelChoice, cached_attention, gemv_ok, gemv_stack, layer_stack, rotated_qkv

SUPPORTED_TYPES = ("llama", "qwen3")
CAPACITY_STEP = 512


def own_contiguous(caches, own: list) -> list:
    """Before a step that writes the caches' buffers in place (engine.fast.mega): every
    buffer not among `own` (the ones that step used last time: replaced since by a reserve,
    an L1 step, a filter...) becomes a row-contiguous array of its own (`mx.contiguous`; the
    kernel would otherwise get a copy and the write would be lost). Returns the new `own`."""
    n = len(caches)
    out = []
    for i, c in enumerate(caches):
        for j, name in ((i, "keys"), (n + i, "values")):
            a = getattr(c, name)
            if not (j < len(own) and own[j] is a):
                a = mx.contiguous(a)
                setattr(c, name, a)
    for name in ("keys", "values"):
        out += [getattr(c, name) for c in caches]
    return out


def as_int32(tokens: mx.array) -> mx.array:
    """Token ids as int32: the sampler's uint32 ids reinterpreted in place (ids are below
    2^31; no copy operation a step), other dtypes converted."""
    if tokens.dtype == mx.int32:
        return tokens
    return mx.view(tokens, mx.int32) if tokens.dtype == mx.uint32 else tokens.astype(mx.int32)


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


@dataclass
class FastStats:
    traces: int = 0        # distinct compiled steps built (one per capacity)
    steps: int = 0         # decode steps run through the fast path
    kernels: bool = False  # CUDA kernels in use (False: stock-MLX reference ops)
    attn_kernel: bool = False
    gemv: bool = False     # projections through engine.fast.gemv (norm / residual / SiLU fused)
    mega: bool = False     # the whole step as one kernel (engine.fast.mega)
    mega_reason: Optional[str] = None   # why not, where it is not used


class FastDecoder:
    """Callable `(tokens [B], caches) -> logits [B, V]` for one decode step."""

    def __init__(self, model, levers: Levers):
        reason = why_not(model)
        if reason:
            raise ValueError(reason)
        self.model = model
        self.levers = levers
        kc = KernelChoice.for_model(model, levers)
        self.use_kernels, self.use_attn_kernel, self._inv_freq, self._mega_freq = (
            kc.use_kernels, kc.use_attn_kernel, kc.inv_freq, kc.mega_freq)
        self._add_rms, self._rope_kernel = kc.add_rms, kc.rope_kernel
        self._fns: dict = {}
        self._version = module_version(model)
        self._pos: Optional[mx.array] = None
        self._pos_host = -1
        self._mega = None
        self._mega_ws = None
        self._own: list = []      # the buffers the one-kernel step last wrote in place
        self._zero = mx.zeros((1,), dtype=mx.int32)     # (the solo row's first column)
        self.stats = FastStats(kernels=self.use_kernels, attn_kernel=self.use_attn_kernel)

    # --- the step, as a pure function of (tokens, position, buffers) ----------------

    def _attention(self, attn, x, pos, keys, values):
        q, k, v = rotated_qkv(attn, x, pos, self._inv_freq, self._rope_kernel)
        keys = mx.slice_update(keys, k, pos, axes=(2,))
        values = mx.slice_update(values, v, pos, axes=(2,))
        o = K.decode_attention(q, keys, values, pos + 1, attn.scale, self.use_attn_kernel)
        return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(x.shape[0], 1, -1)), keys, values

    def _forward(self, tokens, pos, *buffers):
        n = len(self.model.layers)
        ks, vs = list(buffers[:n]), list(buffers[n:])

        def attend(i, attn, x):
            a, ks[i], vs[i] = self._attention(attn, x, pos, ks[i], vs[i])
            return a
        logits = layer_stack(self.model, tokens, attend, self._add_rms)
        return (logits, pos + 1, *ks, *vs)

    # --- the step with every projection through engine.fast.gemv ----------------------

    def gemv_ok(self) -> bool:
        """Whether every projection goes through engine.fast.gemv (see step.gemv_ok)."""
        return gemv_ok(self.model, self.levers)

    def _forward_gemv(self, tokens, pos, *buffers):
        """The step with every projection through engine.fast.gemv (step.gemv_stack)."""
        n = len(self.model.layers)
        ks, vs = list(buffers[:n]), list(buffers[n:])
        length = pos + 1
        attend = cached_attention(ks, vs, pos, length, self.use_attn_kernel)
        logits = gemv_stack(self.model, tokens, attend, pos, self._inv_freq, self.use_kernels,
                            self._rope_kernel)
        return (logits, length, *ks, *vs)

    # --- the step as one kernel (engine.fast.mega) -----------------------------------

    def _forward_mega(self, tokens, pos, *buffers):
        n = len(self.model.layers)
        if self._mega is None:
            self._mega = MG.MegaStep(self.model, self._mega_freq, self.levers.fast)
        logits, wss = self._mega(tokens, pos, pos, self._zero, buffers[:n], buffers[n:])
        # (the buffers are written in place, and stay the caches); the workspace holds
        # the phase timer's stamps with MLXP_MEGA_PROF=1
        return (logits, pos + 1, wss[0]) if self._mega.prof else (logits, pos + 1)

    def mega_profile(self) -> dict:
        """The one-kernel step's phase times of the last step (MLXP_MEGA_PROF=1), else {}."""
        if self._mega is None or self._mega_ws is None:
            return {}
        return self._mega.profile(self._mega_ws)

    def mega_block_arrivals(self) -> dict:
        """The last step's per-block phase arrivals (MLXP_MEGA_PROF=1; MegaStep.block_arrivals), else {}."""
        if self._mega is None or self._mega_ws is None:
            return {}
        return self._mega.block_arrivals(self._mega_ws)

    def _fn(self, capacity: int, rows: int = 1):
        """(the compiled step for this capacity and rows, whether it is the one-kernel step, which
        writes the buffers in place)."""
        # a trace holds the modules as they were: adapters mounted, switched or merged
        # groups split since then need a new one (module_version changes)
        version = module_version(self.model)
        if version != self._version:         # (the old traces are dropped, not kept)
            self._fns, self._version, self._mega = {}, version, None
        entry = self._fns.get((capacity, rows))
        if entry is None:
            self.stats.gemv = self.gemv_ok()
            reason = (MG.why_not(self.model, self.levers) if self._mega_freq is not None else "no RoPE kernel")
            if reason is None and rows != 1:
                reason = "the solo step's one kernel takes one row (the batch lane's takes more)"
            self.stats.mega, self.stats.mega_reason = reason is None, reason
            fwd = (self._forward_mega if self.stats.mega
                   else self._forward_gemv if self.stats.gemv else self._forward)
            entry = (mx.compile(fwd) if self.levers.compiled_decode else fwd, self.stats.mega)
            self._fns[(capacity, rows)] = entry
            self.stats.traces += 1
        return entry

    # --- cache preparation ---------------------------------------------------------

    @staticmethod
    def capacity_for(need: int) -> int:
        """Buffers come in multiples of CAPACITY_STEP tokens, so traces are reused."""
        return (need + CAPACITY_STEP - 1) // CAPACITY_STEP * CAPACITY_STEP

    def reserve(self, caches, extra: int) -> None:
        """Give every cache a buffer with room for `extra` more tokens (copying once)."""
        off = caches[0].offset
        cap = self.capacity_for(off + extra)
        for c in caches:
            have = c.keys.shape[2] if c.keys is not None else 0
            if have >= off + extra and have % CAPACITY_STEP == 0:
                continue
            a0 = self.model.layers[0].self_attn
            B = c.keys.shape[0] if c.keys is not None else 1
            dtype = c.keys.dtype if c.keys is not None else self.model.layers[0].input_layernorm.weight.dtype
            kb = mx.zeros((B, a0.n_kv_heads, cap, a0.head_dim), dtype)
            vb = mx.zeros((B, a0.n_kv_heads, cap, a0.head_dim), dtype)
            if off:
                kb[..., :off, :] = c.keys[..., :off, :]
                vb[..., :off, :] = c.values[..., :off, :]
            c.keys, c.values = kb, vb
        mx.eval([c.state for c in caches])

    def __call__(self, tokens: mx.array, caches) -> mx.array:
        """Logits [B, V] for one new token per row; updates the caches."""
        off = caches[0].offset
        if caches[0].keys is None or off + 1 > caches[0].keys.shape[2]:
            self.reserve(caches, CAPACITY_STEP)
        if self._pos is None or self._pos_host != off:
            self._pos = mx.array([off], dtype=mx.int32)
        n = len(caches)
        fn, in_place = self._fn(caches[0].keys.shape[2], caches[0].keys.shape[0])
        if in_place:                         # (the one-kernel step: contiguous buffers of our own)
            self._own = own_contiguous(caches, self._own)
        out = fn(
            as_int32(tokens).reshape(-1), self._pos,
            *[c.keys for c in caches], *[c.values for c in caches])
        logits, self._pos = out[0], out[1]
        if in_place:                         # (the caches were written in place)
            self._mega_ws = out[2] if len(out) > 2 else None
        for i, c in enumerate(caches):
            if not in_place:
                c.keys, c.values = out[2 + i], out[2 + n + i]
            c.offset += 1
        self._pos_host = off + 1
        self.stats.steps += 1
        return logits
