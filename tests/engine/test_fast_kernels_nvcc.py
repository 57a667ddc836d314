"""Every CUDA kernel of engine/fast compiles (experiments/check_kernels_nvcc.py: a local nvcc,
no GPU; the one-kernel step at several head sizes and weight formats), where nvcc is installed."""

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mega_spills(env: dict) -> dict:
    """Compile every kernel (`env` on top of the environment: check_kernels_nvcc's settings) and
    return the bytes spilled by the bf16 one-kernel step at the 1B and 8B head sizes."""
    return {k: v[0] for k, v in _mega_compile(env).items()}


def _mega_compile(env: dict) -> dict:
    """(bytes spilled, bytes of static shared memory) of the bf16 one-kernel step at the 1B and
    8B head sizes, compiled with `env` (each setting compiled once per test run)."""
    return _compiled(tuple(sorted(env.items())))


@functools.lru_cache(maxsize=None)
def _compiled(items: tuple) -> dict:
    import os
    env = dict(items)
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "check_kernels_nvcc.py")],
                       capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout[-3000:] + r.stderr[-2000:]
    out = {}
    for b in re.split(r"Compiling entry function '", r.stdout):
        name = b.split("'")[0]
        for key in ("k_mega_q0_n0_d64", "k_mega_q0_n0_d128"):
            if key in name:
                spill = re.search(r"(\d+) bytes spill stores", b)
                smem = re.search(r"(\d+) bytes smem", b)
                assert spill is not None and smem is not None, b[:400]
                out[key] = (int(spill.group(1)), int(smem.group(1)))
    assert len(out) == 2, out
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_every_kernel_compiles_without_spilling_much():
    """The bf16 one-kernel step (1B and 8B head sizes) keeps its registers, at most a few bytes
    spilled."""
    spills = _mega_spills({})
    assert all(v <= 16 for v in spills.values()), spills


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_static_shared_memory_is_what_the_launch_counts_on():
    """engine.fast.mega_layout.static_bytes bounds the kernel's static shared memory, so that
    launch_shared asks for a raised limit where static and dynamic together pass 48 KB (without
    it a kernel with more static shared memory failed to launch on an H200: invalid argument)."""
    from engine.fast import mega_layout as ML
    got = _mega_compile({})
    for key, D in (("k_mega_q0_n0_d64", 64), ("k_mega_q0_n0_d128", 128)):
        est = ML.static_bytes(D, 1)
        assert got[key][1] <= est, (key, got[key], est)
        assert est - got[key][1] < 4096, (key, got[key], est)   # (not a loose bound)


def _wrapper_includes() -> set:
    """The engine/fast/cuda files experiments/check_kernels_nvcc.py's translation unit includes,
    directly or through other files of that folder."""
    import importlib.util
    from engine.fast.sources import DIR
    spec = importlib.util.spec_from_file_location("ck", ROOT / "experiments" / "check_kernels_nvcc.py")
    ck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ck)
    todo, seen = set(re.findall(r'#include "([\w.]+)"', ck.source())), set()
    while todo:
        name = todo.pop()
        seen.add(name)
        todo |= set(re.findall(r'#include "([\w.]+)"', (DIR / name).read_text())) - seen
    return seen


def test_the_check_compiles_every_cuda_file_itself():
    """The nvcc check includes every file of engine/fast/cuda (with -I), not a copy of its text:
    a file the engine ships and the check leaves out fails here."""
    from engine.fast.sources import DIR
    shipped = {p.name for p in DIR.iterdir() if p.suffix in (".cu", ".cuh")}
    assert shipped and _wrapper_includes() == shipped


def _ptx(tmp_path, body: str, *defines: str) -> str:
    """PTX of the bf16 RoPE kernel (engine/fast/cuda/rope_qkv.cu) with `defines` (-D)."""
    from engine.fast.sources import DIR
    cu = tmp_path / "k.cu"
    cu.write_text('#include <cuda_bf16.h>\n#include "faults.cuh"\n'
                  "__global__ void k(const __nv_bfloat16* qkv, const float* inv_freq, const int* pos,"
                  " __nv_bfloat16* q, __nv_bfloat16* k, __nv_bfloat16* v) {\n  using T = __nv_bfloat16;\n"
                  "  constexpr int B = 1, H = 4, HKV = 2, D = 64, PER_ROW = 0;\n" + body + "}\n")
    out = tmp_path / "k.ptx"
    subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-I", str(DIR), *[f"-D{d}" for d in defines],
                    "-ptx", str(cu), "-o", str(out)], check=True, capture_output=True, timeout=300)
    return out.read_text()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_fault_exists_only_in_the_build_that_asks_for_it(tmp_path):
    """The production RoPE kernel compiles to the same PTX as one built with the fault macro 0;
    the build with L3_FAULT_SHIFT=1 (the L3 gate's negative control) is different code."""
    body = '#include "rope_qkv.cu"\n'
    prod = _ptx(tmp_path, body)
    assert prod == _ptx(tmp_path, body, "L3_FAULT_SHIFT=0")
    assert prod != _ptx(tmp_path, body, "L3_FAULT_SHIFT=1")
