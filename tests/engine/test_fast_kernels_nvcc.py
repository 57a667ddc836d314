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


# every setting the tests below compile (MEGA_ONLY: the float one-kernel steps only)
_OPT_IN = ({"PRE": "3"}, {"PRE": "2"}, {"KVT": "1"}, {"STG": "1", "QROW": "1", "OGRP": "1", "PRE": "1"},
           {"CHD": "1", "CHC": "1"}, {"PROD": "128"}, {"PROD": "128", "PBULK": "1"})
_ALL = ({}, {"STG": "0", "MEGA_ONLY": "1"}, {"QROW": "1", "DYN": "1", "MEGA_ONLY": "1"}, {"DYN": "2", "MEGA_ONLY": "1"},
        {"STG": "1", "OGRP": "1", "MEGA_ONLY": "1"}) + tuple({**e, "MEGA_ONLY": "1"} for e in _OPT_IN)


@pytest.fixture(scope="module", autouse=True)
def _compile_together():
    """The compiles run side by side, one per CPU (each nvcc takes one), before the tests read
    their results from the cache."""
    if shutil.which("nvcc") is None:
        return
    import os
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as ex:
        list(ex.map(_mega_compile, _ALL))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_every_kernel_compiles_without_spilling_much():
    """The bf16 one-kernel step (1B and 8B head sizes) keeps its registers, at most a few bytes
    spilled: the default kernel (MLXP_MEGA_STAGE on), 0.2.7's (STAGE off), and the opt-in kernels
    that are candidates for the default (MLXP_MEGA_QROW=1 and MLXP_MEGA_DYN=1; MLXP_MEGA_BAL's
    plan-following kernel, DYN 2)."""
    for env in ({}, {"STG": "0", "MEGA_ONLY": "1"}, {"QROW": "1", "DYN": "1", "MEGA_ONLY": "1"},
                {"DYN": "2", "MEGA_ONLY": "1"}):
        spills = _mega_spills(env)
        assert all(v <= 16 for v in spills.values()), (env, spills)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_preloading_kernel_compiles():
    """MLXP_MEGA_PRE=1, =2 and =3's kernels (each phase's first weight loads copied into shared
    memory before the barrier; 2: also each next unit's while a unit runs; 3: into registers)
    and MLXP_MEGA_KVT=1's
    (attention's value loads issued with its key loads), MLXP_MEGA_OGRP=1's (o_proj by groups of
    heads), MLXP_MEGA_CHD=1 MLXP_MEGA_CHC=1's (hand-offs without a barrier) and MLXP_MEGA_PROD's
    (a producer warp streaming the weights into L2) compile too; they
    are opt-in, so their
    registers are not held to a limit."""
    for env in _OPT_IN:
        # (the float one-kernel steps at head sizes 64 and 128 only; _compiled checks that nvcc
        # ended with OK and compiled both)
        assert set(_mega_compile({**env, "MEGA_ONLY": "1"})) == {"k_mega_q0_n0_d64", "k_mega_q0_n0_d128"}
    assert "cp.async" in __import__("engine.fast.mega_device", fromlist=["HEADER"]).HEADER


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_static_shared_memory_is_what_the_launch_counts_on():
    """engine.fast.mega_layout.static_bytes bounds the kernel's static shared memory (with and
    without OGRP's per-warp copies), so that launch_shared asks for a raised limit where static
    and dynamic together pass 48 KB (without it the 8B's OGRP kernel failed to launch on an H200:
    invalid argument)."""
    from engine.fast import mega_layout as ML
    for env, og in (({}, False), ({"STG": "1", "OGRP": "1", "MEGA_ONLY": "1"}, True)):
        got = _mega_compile(env)
        for key, D in (("k_mega_q0_n0_d64", 64), ("k_mega_q0_n0_d128", 128)):
            est = ML.static_bytes(32, D, 8, 2, 1, og)
            assert got[key][1] <= est, (env, key, got[key], est)
            assert est - got[key][1] < 4096, (env, key, got[key], est)   # (not a loose bound)
