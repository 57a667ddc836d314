"""The decode step as one CUDA kernel (the `mega` kernel of the L3 step).

On the H200 the fused step of engine.fast.decode (about 7 kernels a layer) measured as
slow with its kernels emptied as with them running (experiments/l3_overhead.py): the
time goes to building, encoding and launching each operation, not to the GPU's work.
`MegaStep` runs the whole step of a llama-family model, one sequence, as one persistent
kernel (engine/fast/cuda/mega_step.cu, built by engine.fast.mega_cuda: one block per SM,
grid barriers between the phases of a layer), so a step is a handful of operations whatever the layer count.

It is used by `FastDecoder` (one row) and `FastBatchDecoder` (the rows of the batch, up
to `rows_per_call` a kernel call) when `why_not(model, levers)` is None: CUDA,
`perf_kernel` on, the `mega` kernel not disabled (`FastConfig.disabled`), a llama model (or
qwen3, whose per-head q/k norms the kernel applies, unless `FastConfig.qk_norm` is off) with
merged q/k/v and gate/up projections, float weights without bias or affine 4- or 8-bit
weights of one group size (`quantization`; which rows of a 4-bit model take it is
engine.fast.decode's choice), SiLU gating and shapes the kernel's vector loads divide. Otherwise the step of engine.fast.decode runs
as before. The grid is one block per SM (the count read from the CUDA driver).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..levers import Levers
from ..models.base import silu_gate
from . import gemv as G
from . import kernels as K
from . import mega_cuda as C
from .config import FastConfig
from .merge import merged_of

# 16-byte weight loads in flight per lane: one-row phases (o_proj too), paired-row phases
# (16 and 8 measured no faster on the H200: reports/l3/JOURNAL.md)
UN1, UN2 = 8, 4
# the step's phases as the PROF stamps name them (a layer's five, then the head)
PHASES = ("qkv_rope", "attention", "o_proj", "gate_up", "down", "head")


@functools.lru_cache(maxsize=1)
def sm_count() -> int:
    """Streaming multiprocessors of CUDA device 0 (0: unknown): the kernel's grid, one block
    per SM (a grid of 128 on the H100's 132 SMs measured no faster: reports/l3/JOURNAL.md)."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, val = ctypes.c_int(), ctypes.c_int()
        if cu.cuInit(0) or cu.cuDeviceGet(ctypes.byref(dev), 0):
            return 0
        if cu.cuDeviceGetAttribute(ctypes.byref(val), 16, dev):   # MULTIPROCESSOR_COUNT
            return 0
        return int(val.value)
    except OSError:
        return 0


def _parts(model):
    """Per layer (ln1, qkv, o, ln2, gate_up, down) modules, or None where one is missing."""
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = merged_of(attn, ("q_proj", "k_proj", "v_proj"))
        gu = merged_of(mlp, ("gate_proj", "up_proj"))
        if qkv is None or gu is None:
            return None
        out.append((layer.input_layernorm, qkv.linear, attn.o_proj, layer.post_attention_layernorm,
                    gu.linear, mlp.down_proj))
    return out


def why_not(model, levers: Levers) -> Optional[str]:
    """None if `MegaStep` can run this model's decode step, else why not."""
    if not levers.perf_kernel or "mega" in levers.fast.disabled:
        return "the mega kernel is off (perf_kernel off or MLXP_DISABLE_KERNELS=mega)"
    if not K.cuda_available() or sm_count() <= 0:
        return "no CUDA device"
    if getattr(model, "model_type", None) not in ("llama", "qwen3"):
        return "llama and qwen3 models only"
    a0 = model.layers[0].self_attn
    if hasattr(a0, "q_norm") and not levers.fast.qk_norm:
        return "q/k norms in the kernel are off (MLXP_MEGA_QKNORM=0)"
    parts = _parts(model)
    if parts is None:
        return "q/k/v and gate/up must be merged (merged_proj)"
    if any(getattr(layer.mlp, "act", None) is not silu_gate for layer in model.layers):
        return "SiLU gating only"
    norm, head = model.head_parts()
    mods = [m for p in parts for m in (p[1], p[2], p[4], p[5])] + [head, model.model.embed_tokens]
    qz = quantization(model)
    if qz is None and not all(G.is_float(m) for m in mods):
        return "float weights, or affine 4- or 8-bit weights of one group size without bias"
    dts = {weight_dtype(m) for m in mods} | {p[0].weight.dtype for p in parts} | {norm.weight.dtype}
    if len(dts) != 1:
        return "one dtype for every weight"
    dt = dts.pop()
    # elements one lane reads per 16-byte load: the row lengths must be multiples of 32 of them
    vec = 32 * (4 * (32 // qz[0]) if qz else 16 // dt.size)
    H, D = model.args.hidden_size, a0.head_dim
    inter = _inter(parts)
    if H % vec or inter % vec or (a0.n_heads * D) % vec or D % 32 or D % (16 // dt.size):
        return "shapes the kernel's vector loads do not divide"
    if a0.n_heads % a0.n_kv_heads:
        return "query heads must be a multiple of the key/value heads"
    qk_eps = {n.eps for layer in model.layers if hasattr(layer.self_attn, "q_norm")
              for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)}
    if len({p[0].eps for p in parts} | {p[3].eps for p in parts} | {norm.eps} | qk_eps) != 1:
        return "one RMSNorm eps for every norm"
    if C.rows_per_call(H, a0.n_heads, D, inter, dt.size) < 1:
        return f"phase inputs larger than {C.SHARED_MAX} bytes of shared memory"
    return None


def _inter(parts) -> int:
    """The MLP width (half the merged gate/up rows)."""
    return parts[0][4].weight.shape[0] // 2


def weight_dtype(module):
    """The dtype a module's weights compute in (a quantized module's: its scales')."""
    return module.scales.dtype if hasattr(module, "scales") else module.weight.dtype


def quantization(model) -> Optional[tuple]:
    """(bits, group size) when every matrix of the step (the embedding and the head too)
    is an affine 4- or 8-bit QuantizedLinear / QuantizedEmbedding of one group size without
    bias; else None."""
    parts = _parts(model)
    if parts is None:
        return None
    mods = [m for p in parts for m in (p[1], p[2], p[4], p[5])] + [model.head_parts()[1],
                                                                  model.model.embed_tokens]
    kinds = set()
    for m in mods:
        if (type(m) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or "bias" in m
                or "biases" not in m or getattr(m, "mode", "affine") != "affine"):
            return None
        kinds.add((m.bits, m.group_size))
    if len(kinds) != 1:
        return None
    bits, gs = kinds.pop()
    epl = 4 * (32 // bits) if bits in (4, 8) else 0
    return (bits, gs) if epl and gs % epl == 0 and model.args.hidden_size % gs == 0 else None


def rows_per_call(model) -> int:
    """Rows one kernel call of this model's step takes (what its shared memory holds)."""
    a0 = model.layers[0].self_attn
    return C.rows_per_call(model.args.hidden_size, a0.n_heads, a0.head_dim, _inter(_parts(model)),
                           weight_dtype(model.model.embed_tokens).size)


def flow(rows: int) -> int:
    """The kernel's FLOW (a template argument) for a step of `rows` rows: 1 for one row (no grid
    barrier between q/k/v and attention: each head's pairs count up a flag, an attention unit
    waits for its own heads; measured faster on the one-row step with identical logits,
    reports/l3_profile/0.2.6/h200-sweep-flow/), 0 for the batch lane's steps (every call of a
    step of several rows, one of a single row included, keeps the barrier)."""
    return int(rows == 1)


class MegaStep:
    """One decode step of B rows as one kernel per group of up to `rows_per_call` rows:
    `(tokens [B], rpos [B], col [B], start [B], crow [B], keys, values) -> (logits [B, V],
    workspaces)`. Row b is rotated at rpos[b], writes its key and value at column col[b] of
    row crow[b] of each layer's cache buffer [S, Hkv, capacity, D] (in place) and attends over
    columns [start[b], col[b]] of that row. The fast runner passes col = rpos (each row from
    column 0), start 0 and crow its rows' slots (a verify's rows of one slot share it, at
    consecutive columns: calls of several rows keep the grid barrier between the K/V writes and
    attention, and a later call's rows sit at later columns)."""

    def __init__(self, model, inv_freq: mx.array, config: FastConfig = FastConfig()):
        parts = _parts(model)
        a0 = model.layers[0].self_attn
        norm, head = model.head_parts()
        self.L = len(parts)
        self.H = model.args.hidden_size
        self.NQ, self.NKV, self.D = a0.n_heads, a0.n_kv_heads, a0.head_dim
        self.I = _inter(parts)
        self.V = head.weight.shape[0]
        self.dtype = weight_dtype(head)
        self.quant = quantization(model)   # (bits, group size), or None: float weights
        self.eps = norm.eps
        self.scale = a0.scale
        self.blocks = sm_count()
        self.max_rows = C.rows_per_call(self.H, self.NQ, self.D, self.I, self.dtype.size)
        self.inv_freq = inv_freq.astype(mx.float32)
        mat = ((lambda m: [m.weight, m.scales, m.biases]) if self.quant else (lambda m: [m.weight]))
        self.shared = [*mat(model.model.embed_tokens), self.inv_freq, norm.weight, *mat(head)]
        self.layers = [a for p in parts for a in (p[0].weight, *mat(p[1]), *mat(p[2]), p[3].weight,
                                                  *mat(p[4]), *mat(p[5]))]
        self.qkn = hasattr(a0, "q_norm")           # per-head q/k RMSNorm (qwen3)
        if self.qkn:
            self.layers += [w for layer in model.layers
                            for w in (layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)]
        self.prof = config.prof
        self._first = mx.zeros((1,), dtype=mx.float32)     # (`after` of a step's first call)
        # the build's constants (the generated header; the kernel's template: T, RB, ROW0, FLOW)
        self.params = C.MegaParams(
            H=self.H, NQ=self.NQ, NKV=self.NKV, D=self.D, I=self.I, L=self.L, V=self.V,
            EPS_NUM=int(round(self.eps * 1e12)), SCALE_NUM=int(round(self.scale * 1e9)),
            QB=self.quant[0] if self.quant else 0, GS=self.quant[1] if self.quant else 32,
            QKN=int(self.qkn), UN1=UN1, UN2=UN2, UNO=UN1, PROF=int(self.prof))

    def _kernel(self, rows: int):
        smem = C.launch_shared(C.shared_bytes(self.H, self.NQ, self.D, self.I, self.dtype.size, rows),
                               C.static_bytes(self.D, rows))
        return K.cuda_kernel(C.build_name(self.params, rows, smem),
                             C.input_names(self.L, bool(self.quant), self.qkn), ["logits", "ws"],
                             C.body(), C.header() + C.config_header(self.params), shared_memory=smem)

    def groups(self, B: int) -> list:
        """(first row, rows) of each kernel call for B rows."""
        return [(r, min(self.max_rows, B - r)) for r in range(0, B, self.max_rows)]

    def __call__(self, tokens: mx.array, rpos: mx.array, col: mx.array, start: mx.array,
                 crow: mx.array, keys, values):
        B = tokens.size
        ins = [tokens.astype(mx.int32).reshape(B), rpos.astype(mx.int32).reshape(B),
               col.astype(mx.int32).reshape(B), start.astype(mx.int32).reshape(B),
               crow.astype(mx.int32).reshape(B),
               *self.shared, *self.layers, *keys, *values]
        logits, wss = [], []
        for row0, rb in self.groups(B):
            lg, ws = self._kernel(rb)(
                inputs=ins + [wss[-1] if wss else self._first],
                template=[("T", self.dtype), ("RB", rb), ("ROW0", row0), ("FLOW", flow(B))],
                grid=(self.blocks * C.THREADS, 1, 1), threadgroup=(C.THREADS, 1, 1),
                output_shapes=[(rb, self.V),
                               (C.workspace_floats(self.H, self.NQ, self.D, self.I, self.L, rb,
                                                   self.blocks if self.prof else 0),)],
                output_dtypes=[self.dtype, mx.float32], init_value=0)
            logits.append(lg)
            wss.append(ws)
        return (logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)), wss

    def profile(self, ws: mx.array) -> dict:
        """With the phase timer on (`FastConfig.prof`), from a call's workspace: microseconds of its phases (the
        GPU's global timer as block 0 leaves each barrier), summed over the layers, and the
        total; and `arrive`: for each phase, when the blocks had finished their share,
        counted from the phase's start and summed over the layers — the first block
        (`min`), the median one and the last (`max`). A phase whose median is far below its
        max waits on a few slow blocks; what lies between max and the phase time is the
        barrier itself."""
        t, per = self._stamps(ws)
        n = len(t)
        d = [(t[i + 1] - t[i]) / 1e3 for i in range(n - 1)]
        out = {ph: round(sum(d[5 * l + j] for l in range(self.L)), 2) for j, ph in enumerate(PHASES[:5])}
        out["head"] = round(d[-1], 2)
        out["total"] = round((t[-1] - t[0]) / 1e3, 2)
        if per:
            out["arrive"] = {}
            for k, rows in per.items():
                spreads = [(min(a), sorted(a)[len(a) // 2], max(a)) for a in rows]
                sums = [sum(q) for q in zip(*spreads)]
                out["arrive"][k] = {q: round(v, 2) for q, v in zip(("min", "median", "max"), sums)}
        return out

    def block_arrivals(self, ws: mx.array) -> dict:
        """With the phase timer on (and the blocks' stamps): for each phase, one list per layer
        (the head: one list) of the µs after the phase's start at which each block (by index)
        had finished its share."""
        return self._stamps(ws)[1]

    def _stamps(self, ws: mx.array):
        n, nb = C.n_stamps(self.L), self.blocks
        raw = mx.view(ws[-2 * n * (1 + nb):], mx.uint32).tolist()
        t = [raw[2 * i] + (raw[2 * i + 1] << 32) for i in range(n)]
        arr = raw[2 * n:]
        per = {}
        if nb and len(arr) == 2 * n * nb:
            def at(i):      # the blocks' arrivals at stamp i, µs after stamp i - 1
                return [((arr[2 * (i * nb + b)] + (arr[2 * (i * nb + b) + 1] << 32)) - t[i - 1]) / 1e3
                        for b in range(nb)]
            per = {ph: [at(1 + 5 * l + j) for l in range(self.L)] for j, ph in enumerate(PHASES[:5])}
            per["head"] = [at(n - 1)]
        return t, per
