"""Every CUDA kernel of engine/fast compiles (experiments/check_kernels_nvcc.py: a local nvcc,
no GPU; the one-kernel step at several head sizes and weight formats), where nvcc is installed."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_every_kernel_compiles_without_spilling_much():
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "check_kernels_nvcc.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout[-3000:] + r.stderr[-2000:]
    # the bf16 one-kernel step (1B and 8B head sizes, the step that runs by default) keeps its
    # registers: at most a few bytes spilled
    blocks = re.split(r"Compiling entry function '", r.stdout)
    mega = [b for b in blocks if "k_mega_q0_n0_d64" in b.split("'")[0] or "k_mega_q0_n0_d128" in b.split("'")[0]]
    assert len(mega) == 2
    for b in mega:
        spill = re.search(r"(\d+) bytes spill stores", b)
        assert spill is not None and int(spill.group(1)) <= 16, b[:400]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_preloading_kernel_compiles():
    """MLXP_MEGA_PRE=1 and =2's kernels (each phase's first weight loads copied into shared
    memory before the barrier; 2: also each next unit's while a unit runs) and MLXP_MEGA_KVT=1's
    (attention's value loads issued with its key loads) and MLXP_MEGA_STAGE=0's (each phase's input
read element by element, as in 0.2.6) compile too; they are opt-in, so their
    registers are not held to a limit."""
    import os
    for env in ({"PRE": "1"}, {"PRE": "2"}, {"KVT": "1"}, {"STG": "0"}):
        r = subprocess.run([sys.executable, str(ROOT / "experiments" / "check_kernels_nvcc.py")],
                           capture_output=True, text=True, timeout=600, env={**os.environ, **env})
        assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout[-3000:] + r.stderr[-2000:]
    assert "cp.async" in __import__("engine.fast.mega_device", fromlist=["HEADER"]).HEADER
