"""Fused decode kernels (CUDA, through `mx.fast.cuda_kernel`) and their stock-MLX references.

Every public function here takes a `use_kernel` flag: True runs the CUDA kernel
(only on an NVIDIA GPU), False runs the same math with stock MLX ops, which is
what the CPU (and CI) exercises. The kernels compile at run time (NVRTC) on the
first call with a given shape; nothing is built at install time.

- `add_rms_norm(x, r, w, eps)`: h = x + r and RMSNorm(h) * w in one pass (the
  residual add folded into the next layer norm).
- `rope_qkv(qkv, inv_freq, pos, ...)`: split a merged q/k/v projection row into
  heads, rotate q and k at position `pos` (a device array: one position [1] for
  every row, or one per row [B]), copy v.
- `decode_attention(q, K, V, length, scale, start=)`: one query token against the
  keys of a preallocated cache from column `start[b]` (per row, default 0: the
  batch's left padding) up to `length` (a device scalar), split over key chunks in
  one kernel and combined in a second (flash-decoding).

`fault` (see `inject_fault`) deliberately breaks one of these for the negative
control of the L3 gate: a gate that passes a broken kernel would prove nothing. On the
GPU the broken kernel is a build of its own (`cuda_kernel`: its fault macro defined,
another name); the production kernels take no fault parameter. The CUDA sources are
engine/fast/cuda/*.cu (`engine.fast.sources`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import mlx.core as mx

from .sources import source

FAULTS = ("attn_drop_last_key", "rope_pos_plus_one")
# the macro each fault's build defines (engine/fast/cuda/faults.cuh)
FAULT_MACROS = {"attn_drop_last_key": "L3_FAULT_DROP", "rope_pos_plus_one": "L3_FAULT_SHIFT"}
_fault: Optional[str] = None


@contextmanager
def inject_fault(name: str):
    """Within this block the named fault is active (kernel and reference path alike)."""
    global _fault
    if name not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}")
    old, _fault = _fault, name
    try:
        yield
    finally:
        _fault = old


def active_fault() -> Optional[str]:
    return _fault


def cuda_available() -> bool:
    """Whether the default device is an NVIDIA GPU (where the kernels run)."""
    if mx.default_device() != mx.gpu:
        return False
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return not mx.metal.is_available()


_kernels: dict = {}
_empty = False


@contextmanager
def empty_kernels():
    """For timing experiments only (experiments/l3_overhead.py): within this block every
    kernel built here and in engine.fast.gemv returns at once, so its outputs are garbage;
    a step built with them costs its launches and host work but no GPU work."""
    global _empty
    old, _empty = _empty, True
    try:
        yield
    finally:
        _empty = old


def kernel_variant(name: str, source: str) -> tuple:
    """(name, source) of the kernel to build: inside `empty_kernels`, a separately named
    kernel whose body returns at once."""
    if _empty:
        return name + "_empty", "  if (threadIdx.x < 100000) return;\n" + source
    return name, source


def cuda_kernel(name: str, inputs, outputs, source: str, header: str = "", shared_memory: int = 0):
    """mx.fast.cuda_kernel, built once per name (an empty body inside `empty_kernels`);
    `shared_memory`: bytes of dynamic shared memory (`extern __shared__`). Inside
    `inject_fault`, a kernel whose source reads that fault's macro is built as another
    kernel (`NAME_FAULT`) with the macro defined; the production kernel is never touched."""
    macro = FAULT_MACROS.get(_fault)
    if macro is not None and macro in source:
        name, header = f"{name}_{_fault}", f"#define {macro} 1\n" + header
    name, source = kernel_variant(name, source)
    if name not in _kernels:
        kw = {"shared_memory": shared_memory} if shared_memory else {}
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                                             source=source, header=header, **kw)
    return _kernels[name]


# --- residual add + RMSNorm ---------------------------------------------------

def add_rms_norm(x: mx.array, r: mx.array, w: mx.array, eps: float, use_kernel: bool):
    """(x + r, rms_norm(x + r) * w) over the last axis."""
    if not use_kernel:
        h = x + r
        return h, mx.fast.rms_norm(h, w, eps)
    D = x.shape[-1]
    rows = x.size // D
    k = cuda_kernel("mlxp_add_rms", ["x", "r", "w"], ["h", "y"], source("add_rms.cu"))
    h, y = k(inputs=[x, r, w], template=[("T", x.dtype), ("D", D), ("EPS_NUM", int(round(eps * 1e9)))],
             grid=(rows * 256, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, y


# --- RoPE + q/k/v split ---------------------------------------------------------

def rope_qkv(qkv: mx.array, inv_freq: mx.array, pos: mx.array, n_heads: int, n_kv: int,
             head_dim: int, rope, use_kernel: bool):
    """q [B,H,1,D], k [B,Hkv,1,D] rotated at position pos[0] (pos [1]) or row b at
    pos[b] (pos [B]); v [B,Hkv,1,D].

    `qkv` is the merged projection's output [B, 1, (H + 2 Hkv) * D]; `rope` is the
    model's own RoPE module (the reference path calls it), `inv_freq` its inverse
    frequencies (the kernel path reads them)."""
    B = qkv.shape[0]
    if pos.size not in (1, B):
        raise ValueError(f"pos must hold 1 or {B} positions, got {pos.size}")
    shift = 1 if _fault == "rope_pos_plus_one" else 0
    if not use_kernel:
        q, k, v = mx.split(qkv, [n_heads * head_dim, (n_heads + n_kv) * head_dim], axis=-1)
        q = q.reshape(B, 1, n_heads, head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, 1, n_kv, head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, 1, n_kv, head_dim).transpose(0, 2, 1, 3)
        p = pos + shift if shift else pos
        return rope(q, offset=p), rope(k, offset=p), v
    kern = cuda_kernel("mlxp_rope_qkv", ["qkv", "inv_freq", "pos"], ["q", "k", "v"], source("rope_qkv.cu"),
                       source("faults.cuh"))
    n = B * (n_heads + 2 * n_kv) * (head_dim // 2)
    q, k, v = kern(inputs=[qkv, inv_freq, pos],
                   template=[("T", qkv.dtype), ("B", B), ("H", n_heads), ("HKV", n_kv),
                             ("D", head_dim), ("PER_ROW", int(pos.size > 1))],
                   grid=((n + 127) // 128 * 128, 1, 1), threadgroup=(128, 1, 1),
                   output_shapes=[(B, n_heads, 1, head_dim), (B, n_kv, 1, head_dim),
                                  (B, n_kv, 1, head_dim)],
                   output_dtypes=[qkv.dtype] * 3)
    return q, k, v


def rope_inv_freq(rope, head_dim: int) -> mx.array:
    """Inverse frequencies [D/2] (float32) of an nn.RoPE or a FreqRoPE-style module
    (position * scale * inv_freq is the angle, as in `mx.fast.rope`)."""
    if getattr(rope, "dims", head_dim) != head_dim or getattr(rope, "traditional", False):
        raise ValueError("the RoPE kernel handles full-width, non-traditional RoPE only")
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None:
        return (1.0 / freqs.astype(mx.float32)) * getattr(rope, "scale", 1.0)
    base, scale = rope.base, rope.scale
    return scale * mx.power(mx.array(base, mx.float32),
                            -mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)


# --- decode attention -----------------------------------------------------------

# one kernel, no combine pass, up to this many cached positions: one block per head,
# each of its 8 warps takes every 8th key (each kernel launch costs more than the
# parallelism a second pass buys at short contexts)
SINGLE_PASS_MAX = 512


def n_splits(capacity: int) -> int:
    """Key chunks per head: enough blocks to fill the GPU at long contexts; 1 (a single
    pass, no combine) up to SINGLE_PASS_MAX."""
    if capacity <= SINGLE_PASS_MAX:
        return 1
    return max(1, min(32, (capacity + 255) // 256))


def decode_attention(q: mx.array, keys: mx.array, values: mx.array, length: mx.array,
                     scale: float, use_kernel: bool, start: Optional[mx.array] = None,
                     crow: Optional[mx.array] = None) -> mx.array:
    """softmax(q K[start:length]^T * scale) V[start:length] for one query token per row.

    q [B,H,1,D]; keys/values [B,Hkv,CAP,D] preallocated; length: int32 on the device, [1]
    (every row) or [B] (one a row: the fast runner's rows each at their own column);
    start: int32 [B], row b's first key column (rows of the batch are left-padded), or
    None (every row from column 0); crow: int32 [B], the row of keys/values that row b of q
    reads (a verify's rows of one slot share it: engine.fast.slots), or None (row b)."""
    drop = 1 if _fault == "attn_drop_last_key" else 0
    B, H, _, D = q.shape
    Hkv, cap = keys.shape[1], keys.shape[2]
    rowlen = int(length.size > 1)
    if not use_kernel:
        if crow is not None:
            keys, values = keys[crow], values[crow]
        cols = mx.arange(cap)
        valid = cols < (length - drop).reshape(-1, 1)
        if start is not None:
            valid = valid & (cols >= start.reshape(B, 1))
        valid = valid.reshape(valid.shape[0], 1, 1, cap)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=valid)
    if D % 32 or D > 256:
        raise ValueError("decode_attention kernel needs head_dim a multiple of 32, at most 256")
    ns = n_splits(cap)
    common = [("T", q.dtype), ("H", H), ("HKV", Hkv), ("D", D), ("NS", ns)]
    # (the solo step passes no start column: the kernel then reads none, and no zeros
    # array is made every layer of every step)
    extra = [("CAP", cap), ("SCALE_NUM", int(round(scale * 1e9))),
             ("USE_START", int(start is not None)), ("ROWLEN", rowlen), ("USE_CROW", int(crow is not None))]
    ins = [q, keys, values, length, start.astype(mx.int32) if start is not None else length,
           crow if crow is not None else length]
    if ns == 1:
        single = cuda_kernel("mlxp_attn_single", ["q", "keys", "values", "length", "start", "crow"],
                             ["out"],
                             source("attn_single.cu"), source("faults.cuh"))
        (out,) = single(inputs=ins, template=common + extra,
                        grid=(B * H * 256, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype])
        return out
    part = cuda_kernel("mlxp_attn_partial", ["q", "keys", "values", "length", "start", "crow"],
                       ["partial"],
                       source("attn_partial.cu"), source("faults.cuh"))
    (partial,) = part(inputs=ins, template=common + extra,
                      grid=(B * H * ns * 256, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=[(B * H * ns, D + 2)], output_dtypes=[mx.float32])
    comb = cuda_kernel("mlxp_attn_combine", ["partial"], ["out"], source("attn_combine.cu"))
    threads = (D + 31) // 32 * 32
    (out,) = comb(inputs=[partial], template=common,
                  grid=(B * H * threads, 1, 1), threadgroup=(threads, 1, 1),
                  output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype])
    return out

