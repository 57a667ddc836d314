"""Run a worker script on N local ranks with `mlx.launch --backend ring`, bounded in time."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class LaunchResult:
    returncode: int
    output: str
    ranks: list  # each rank's rank<R>.json, in rank order


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int) -> int:
    """A first port such that port..port+n-1 are free on 127.0.0.1."""
    for _ in range(200):
        p = random.randint(20000, 60000)
        if all(_free(p + i) for i in range(n)):
            return p
    raise RuntimeError("no free port block found")


def launch(script: str, args: list, out: Path, n: int = 2, timeout: float = 120,
           backend: str = "ring") -> LaunchResult:
    """`mlx.launch -n N --backend ring -- python3 SCRIPT OUT ARGS...`; each rank writes
    OUT/rank<R>.json. The whole process group is killed at `timeout`. N = 1 runs the
    script plainly (a launch needs two hosts or more; one process is a world of one)."""
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        raise RuntimeError("mlx.launch is not on PATH (it comes with the mlx package)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(REPO / script), str(out), *map(str, args)]
    if n > 1:
        cmd = [launcher, "-n", str(n), "--backend", backend,
               "--starting-port", str(free_port_block(n)), "--cwd", str(REPO), "--", *cmd]
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        raise AssertionError(f"mlx.launch timed out after {timeout}s:\n{output[-4000:]}")
    ranks = []
    for r in range(n):
        f = Path(out) / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    return LaunchResult(proc.returncode, output, ranks)
