"""Compile the fused decode kernels with a local nvcc (no GPU needed) to catch CUDA errors
before spending device time: the files of engine/fast/cuda themselves, included (`-I`) into
wrappers that mimic what `mx.fast.cuda_kernel` generates (inputs `const T*`, outputs `T*`,
template values as constexpr; the one-kernel step's constants from its generated header).

    python experiments/check_kernels_nvcc.py            # prints ptxas register/spill report
    MEGA_ONLY=1 ...                                     # only the float one-kernel steps
    RB=4 FLOW=0 ...                                     # its rows a call (default 1), FLOW
    FAULTS=1 ...                                        # the L3 gate's fault build (L3_FAULT_*)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fast import mega as MG  # noqa: E402
from engine.fast import mega_cuda as MC  # noqa: E402
from engine.fast.sources import DIR  # noqa: E402


def inc(*files: str) -> str:
    """A kernel body made of engine/fast/cuda files."""
    return "".join(f'#include "{f}"\n' for f in files)


_ATTN_IN = [("q", "T"), ("keys", "T"), ("values", "T"), ("length", "int32_t"), ("start", "int32_t"),
           ("crow", "int32_t")]
SPECS = {
    "add_rms": (inc("add_rms.cu"), [("x", "T"), ("r", "T"), ("w", "T")], [("h", "T"), ("y", "T")],
                dict(D=2048, EPS_NUM=10000)),
    "rope_qkv": (inc("rope_qkv.cu"), [("qkv", "T"), ("inv_freq", "float"), ("pos", "int32_t")],
                 [("q", "T"), ("k", "T"), ("v", "T")], dict(B=8, H=32, HKV=8, D=64, PER_ROW=1)),
    "attn_partial": (inc("attn_partial.cu"), _ATTN_IN, [("partial", "float")],
                     dict(H=32, HKV=8, D=64, NS=9, CAP=2304, SCALE_NUM=125000000, USE_START=1, ROWLEN=0, USE_CROW=0)),
    "attn_single": (inc("attn_single.cu"), _ATTN_IN, [("out", "T")],
                    dict(H=32, HKV=8, D=64, NS=1, CAP=512, SCALE_NUM=125000000, USE_START=0, ROWLEN=1, USE_CROW=1)),
    "attn_combine": (inc("attn_combine.cu"), [("partial", "float")], [("out", "T")],
                     dict(H=32, HKV=8, D=64, NS=9)),
    # deterministic mode's batch-invariant attention (engine/fast/invariant.py)
    "attn_rows": (inc("attn_rows.cu"), [("q", "T"), ("keys", "T"), ("values", "T"), ("lo_row", "int32_t"),
                                        ("hi_q", "int32_t"), ("mask", "bool"), ("scale", "float"),
                                        ("dims", "int32_t")], [("partial", "float")],
                  dict(H=32, HKV=8, D=64, QT=16, CH=256)),
    "attn_rows_combine": (inc("attn_rows_combine.cu"), [("partial", "float"), ("dims", "int32_t")],
                          [("out", "T")], dict(D=64)),
}
_GEMV_IO = ([("W", "T"), ("x", "T"), ("norm_w", "T"), ("residual", "T")], [("out", "T")])
for _name, _t in {"gemv_norm": dict(K=2048, NOUT=3072, B=1, R=1, NORM=1, EPI=0, ROPE_D=0, EPS_NUM=10**7),
                  "gemv_res": dict(K=8192, NOUT=2048, B=1, R=1, NORM=0, EPI=1, ROPE_D=0, EPS_NUM=0),
                  "gemv_silu": dict(K=2048, NOUT=8192, B=1, R=1, NORM=1, EPI=2, ROPE_D=0, EPS_NUM=10**7),
                  "gemv_b8": dict(K=4096, NOUT=14336, B=8, R=2, NORM=1, EPI=2, ROPE_D=0, EPS_NUM=10**7)}.items():
    # the warp-per-row layout (R = 1, 8 warps a block)
    SPECS[_name + "_warp"] = (inc("gemv_main.cu", "gemv_epilogue.cu"), *_GEMV_IO,
                              {**_t, "R": 1, "WARPS_PB": 8, "UNROLL": 4, "KSPLIT": 4 if _t["NOUT"] < 4096 else 1})
_ROPE_IO = ([("W", "T"), ("x", "T"), ("norm_w", "T"), ("inv_freq", "float"), ("pos", "int32_t")],
            [("q", "T"), ("k", "T"), ("v", "T")])
_ROPE_T = dict(K=2048, NOUT=3072, B=4, R=2, NORM=1, EPI=0, ROPE_D=64, NQ=32, NKV=8, PER_ROW=1,
               EPS_NUM=10**7)
SPECS["gemv_rope_warp"] = (inc("gemv_main.cu", "gemv_rope_epilogue.cu"), *_ROPE_IO,
                           {**_ROPE_T, "R": 1, "WARPS_PB": 8, "UNROLL": 4, "KSPLIT": 2})

# bf16 only: the 4-bit tensor-core projections of the fast step's rows past the one kernel
_QMM_IO = ([("w", "uint32_t"), ("scales", "T"), ("biases", "T"), ("x", "T"), ("residual", "T")], [("y", "T")])
BF16_SPECS = {f"qmm_{n}": (inc("qmm_rows.cu"), *_QMM_IO, t) for n, t in {
    "plain_m32": dict(K=4096, NOUT=6144, M=32, MT=4, GS=64, WARPS=8, KS=8, UN=2, EPI=0),
    "res_m16": dict(K=14336, NOUT=4096, M=16, MT=2, GS=64, WARPS=8, KS=8, UN=2, EPI=1),
    "silu_m9": dict(K=4096, NOUT=14336, M=9, MT=2, GS=128, WARPS=8, KS=4, UN=4, EPI=2),
    "plain_m1": dict(K=2048, NOUT=128256, M=1, MT=1, GS=32, WARPS=4, KS=1, UN=2, EPI=0)}.items()}

PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace mlx::core::cu {
namespace cg = cooperative_groups;
struct Shape { int data_[8]; __device__ int operator[](int i) const { return data_[i]; } };
"""


def mega_kernel(name: str, shape: tuple, env, qb: int = 0, qkn: int = 0, maxch: int = MC.MAXCH,
                prof: int = 0, gs: int = 0) -> str:
    """The bf16 one-kernel step as a kernel `name` of the shapes (H, NQ, NKV, D, I, L, V), its
    weights float or `qb`-bit (groups of `gs`: 64, or for float weights the 32 MegaStep gives),
    with the settings in `env` (RB: rows a call; FLOW: 1 or 0, by default 1 for one row as
    MegaStep chooses it): its generated header and a wrapper that
    includes mega_step.cu, in a namespace of their own. Needs mega_device.cuh before it."""
    H, NQ, NKV, D, I, L, V = shape
    rb = int(env.get("RB", 1))
    flow = int(env.get("FLOW", MG.flow(rb)))      # (as MegaStep chooses it, unless FLOW is set)
    names = MC.input_names(L, quantized=bool(qb), qk_norm=bool(qkn))
    mats = {"emb", "headw"} | {f"{k}_{i}" for k in MC.QUANT for i in range(L)}

    def ty(n):
        if n in ("tok", "rpos", "col", "start_col", "crow"):
            return "int32_t"
        if n in ("inv_freq", "after"):
            return "float"
        return "uint32_t" if (qb and n in mats) else "__nv_bfloat16"
    args = ", ".join(f"const {ty(n)}* {n}" for n in names)
    params = MC.MegaParams(H=H, NQ=NQ, NKV=NKV, D=D, I=I, L=L, V=V, EPS_NUM=10**7, SCALE_NUM=125000000,
                           QB=qb, GS=gs or (64 if qb else 32), QKN=qkn, UN1=MG.UN1, UN2=MG.UN2, UNO=MG.UN1,
                           PROF=prof, MAXCH=maxch)
    return (f"namespace {name}_build {{\n" + MC.config_header(params)
            + f"__global__ void {name}({args}, const __grid_constant__ Shape k_0_shape, "
            "__nv_bfloat16* logits, float* ws) {\n  using T = __nv_bfloat16;\n"
            f"  constexpr int RB = {rb};\n  constexpr int ROW0 = 0;\n  constexpr int FLOW = {flow};\n"
            + inc("mega_step.cu") + "}\n}\n")


def source() -> str:
    # (MEGA_ONLY=1: only the float one-kernel steps at head sizes 64 and 128; the whole set
    # takes three times as long to compile)
    mega_only = os.environ.get("MEGA_ONLY") == "1"
    src = PRELUDE + "}\n" + inc("gemv.cuh") + "namespace mlx::core::cu {\n"
    for name, (body, ins, outs, tmpl) in ({} if mega_only else SPECS).items():
        for T in ("__nv_bfloat16", "__half", "float"):
            ty = lambda t: T if t == "T" else t  # noqa: E731
            args = [f"const {ty(t)}* {n}" for n, t in ins] + [f"{ty(t)}* {n}" for n, t in outs]
            src += f"__global__ void k_{name}_{T.strip('_')}({', '.join(args)}) {{\n  using T = {T};\n"
            src += "".join(f"  constexpr int {k} = {v};\n" for k, v in tmpl.items()) + body + "\n}\n"
    for name, (body, ins, outs, tmpl) in ({} if mega_only else BF16_SPECS).items():
        ty = lambda t: "__nv_bfloat16" if t == "T" else t  # noqa: E731
        args = [f"const {ty(t)}* {n}" for n, t in ins] + [f"{ty(t)}* {n}" for n, t in outs]
        src += f"__global__ void k_{name}({', '.join(args)}) {{\n  using T = __nv_bfloat16;\n"
        src += "".join(f"  constexpr int {k} = {v};\n" for k, v in tmpl.items()) + body + "\n}\n"
    # the one-kernel step (1B shapes, 16 layers): float, 4-bit and 8-bit weights, float with
    # q/k norms, and float with 8B's head size (128) and an odd multiple of 32 (96), each of one
    # row (FLOW 1), and float of 4 rows (FLOW 0); its header redefines __global__ (launch bounds)
    src += "}\n" + inc("mega_device.cuh") + "namespace mlx::core::cu {\n"
    shapes = ((0, 0, 64), (0, 0, 128)) if mega_only else ((0, 0, 64), (4, 0, 64), (8, 0, 64), (0, 1, 64),
                                                           (0, 0, 128), (0, 0, 96))
    for qb, qkn, D in shapes:
        src += mega_kernel(f"k_mega_q{qb}_n{qkn}_d{D}_bf16", (32 * D, 32, 8, D, 8192, 16, 128256), os.environ,
                           qb=qb, qkn=qkn, maxch=16, prof=1)
    if not mega_only:    # the batch lane's build: 4 rows a call, FLOW 0 (the grid barrier before attention)
        src += mega_kernel("k_mega_b4_q0_d64_bf16", (2048, 32, 8, 64, 8192, 16, 128256), {"RB": 4},
                           maxch=16, prof=1)
    return src + "}\n"


def nvcc_command(nvcc: str, cu: Path, out: Path, *extra: str) -> list:
    """nvcc on `cu` with engine/fast/cuda on the include path (FAULTS=1: the fault build)."""
    faults = ["-DL3_FAULT_SHIFT=1", "-DL3_FAULT_DROP=1"] if os.environ.get("FAULTS") == "1" else []
    return [nvcc, "-arch=sm_90", "-std=c++17", "-diag-suppress", "177", "-I", str(DIR), *faults, *extra,
            str(cu), "-o", str(out)]


def main() -> int:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("check_kernels_nvcc: nvcc not found", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "k.cu"
        cu.write_text(source())
        r = subprocess.run(nvcc_command(nvcc, cu, Path(d) / "k.o", "-c", "-Xptxas", "-v"),
                           capture_output=True, text=True)
    print(r.stdout + r.stderr)
    print("OK" if r.returncode == 0 else "FAILED")
    return r.returncode


if __name__ == "__main__":
    raise SystemExit(main())
