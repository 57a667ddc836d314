"""The one-kernel decode step's CUDA build (engine.fast.mega): its body is
engine/fast/cuda/mega_step.cu (with mega_qkv.cu and mega_attn.cu), its device functions
mega_device.cuh; this module makes the rest: the kernel's input names (`input_names`), and the
generated header of one model's constants and per-layer pointer tables (`config_header`),
which replaces what were two dozen template arguments (the kernel keeps four: T, RB, ROW0 and
FLOW, 1 for the calls of one row).
The workspace and shared-memory sizes are engine.fast.mega_layout's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import mega_layout as L_
from .sources import source

THREADS = 512
# (mega_layout.WPB is THREADS // 32)
WPB = L_.WPB
MAXCH = L_.MAXCH
# the workspace's and shared memory's sizes (engine.fast.mega_layout)
workspace_floats, n_stamps, input_bytes = L_.workspace_floats, L_.n_stamps, L_.input_bytes
shared_bytes, rows_per_call = L_.shared_bytes, L_.rows_per_call
SHARED_MAX, MAX_ROWS = L_.SHARED_MAX, L_.MAX_ROWS
static_bytes, launch_shared = L_.static_bytes, L_.launch_shared


def header() -> str:
    """The device functions every build of the kernel is compiled with."""
    return source("mega_device.cuh")


def body() -> str:
    """The kernel's body (mega_step.cu, its phases' files inlined)."""
    return source("mega_step.cu")


@dataclass(frozen=True)
class MegaParams:
    """One model's constants of the kernel (namespace mlxp_mega of the generated header)."""
    H: int                  # hidden size
    NQ: int                 # query heads
    NKV: int                # key/value heads
    D: int                  # head size
    I: int                  # MLP width  # noqa: E741
    L: int                  # layers
    V: int                  # vocabulary
    EPS_NUM: int            # RMSNorm eps x 1e12
    SCALE_NUM: int          # attention scale x 1e9
    QB: int = 0             # weight bits (0: float weights)
    GS: int = 32            # quantization group size
    QKN: int = 0            # per-head q/k RMSNorm (qwen3)
    UN1: int = 8            # 16-byte weight loads in flight per lane: one-row phases,
    UN2: int = 4            # paired-row phases,
    UNO: int = 8            # o_proj
    PROF: int = 0           # the phase timer
    MAXCH: int = MAXCH      # cache chunks per query head in the attention phase (at most)
    THREADS: int = THREADS  # threads a block


PER_LAYER = ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")


QUANT = ("wqkv", "wo", "wgu", "wd")       # per layer, the matrices (quantized: + _s, _b)


def input_names(n_layers: int, quantized: bool = False, qk_norm: bool = False) -> list:
    """The kernel's inputs, in order: the step's scalars and shared weights, then per
    layer its norms and projections, (with `qk_norm` then per layer its q and k norm
    weights,) then the key and value caches; with `quantized` every weight matrix (the
    embedding and the head too) is followed by its group scales (`_s`) and biases (`_b`)."""
    q = (lambda n: [n, f"{n}_s", f"{n}_b"]) if quantized else (lambda n: [n])
    names = ["tok", "rpos", "col", "start_col", "crow", *q("emb"), "inv_freq", "fnorm", *q("headw")]
    for i in range(n_layers):
        for k in PER_LAYER:
            names += q(f"{k}_{i}") if k in QUANT else [f"{k}_{i}"]
    if qk_norm:
        names += [n for i in range(n_layers) for n in (f"qn_{i}", f"kn_{i}")]
    names += [f"k_{i}" for i in range(n_layers)] + [f"v_{i}" for i in range(n_layers)]
    # not read: the previous call's workspace, so that MLX orders the calls of one step
    # (two of these kernels running at once could each hold SMs the other waits for)
    return names + ["after"]


def config_header(p: MegaParams) -> str:
    """The generated header of one model's build: its constants in namespace mlxp_mega, and
    MEGA_TABLES, the per-layer pointer tables the body declares (weight matrices as `const
    void*`: T elements, or packed words for quantized weights (QB); their scale and bias tables
    hold null pointers for float weights, as do the q/k norm tables without QKN)."""
    n = p.L

    def table(name, key, kind="const T*", suffix=""):
        cast = "const_cast<T*>({})" if kind == "T*" else "{}"
        items = ", ".join(cast.format(f"{key}_{i}{suffix}") for i in range(n))
        return [f"{kind} {name}[{n}] = {{{items}}};"]

    def matrix(name, key):
        if p.QB:
            return table(name, key, "const void*") + table(name + "_S", key, suffix="_s") + table(
                name + "_B", key, suffix="_b")
        return table(name, key, "const void*") + [f"const T* {name}_S[{n}] = {{}};",
                                                   f"const T* {name}_B[{n}] = {{}};"]
    rows = (table("LN1", "ln1") + matrix("WQKV", "wqkv") + matrix("WO", "wo") + table("LN2", "ln2")
            + matrix("WGU", "wgu") + matrix("WD", "wd") + table("KC", "k", "T*") + table("VC", "v", "T*"))
    rows += (table("QN", "qn") + table("KN", "kn")) if p.QKN else [f"const T* QN[{n}] = {{}};",
                                                                   f"const T* KN[{n}] = {{}};"]
    if p.QB:
        rows += ["const T* EMB_S = emb_s; const T* EMB_B = emb_b;",
                 "const T* HEAD_S = headw_s; const T* HEAD_B = headw_b;"]
    else:
        rows += ["const T* EMB_S = nullptr; const T* EMB_B = nullptr;",
                 "const T* HEAD_S = nullptr; const T* HEAD_B = nullptr;"]
    consts = "\n".join(f"constexpr int {k} = {v};" for k, v in vars(p).items())
    tables = " \\\n".join("  " + r for r in rows)
    return (f"// generated by engine.fast.mega_cuda.config_header\n#undef MEGA_TABLES\n"
            f"namespace mlxp_mega {{\n{consts}\n}}  // namespace mlxp_mega\n"
            f"#define MEGA_TABLES \\\n{tables}\n")


def build_name(p: MegaParams, rows: int, smem: int) -> str:
    """The kernel's name: one per model build (its generated header), rows a call and shared
    memory (MLX keeps compiled kernels by name)."""
    digest = hashlib.sha1(config_header(p).encode()).hexdigest()[:12]
    return f"mlxp_mega_{digest}_r{rows}_s{smem}"
