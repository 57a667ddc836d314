import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLXP_FIXTURE_DIR", str(ROOT / ".cache" / "fixtures"))


@pytest.fixture
def hold_dir():
    """hold_dir(d): another process creates directory `d` and holds it as a prompt cache
    directory (engine.kv.disk_dir) until the test ends; returns that process."""
    import subprocess
    held = []

    def hold(d):
        p = subprocess.Popen(
            [sys.executable, "-c", "import os, sys, time; from engine.kv.disk_dir import "
             "claim_cache_dir; os.makedirs(sys.argv[1]); claim_cache_dir(sys.argv[1]); "
             "print('held', flush=True); time.sleep(120)", str(d)],
            stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + sys.path)})
        held.append(p)
        assert p.stdout.readline().strip() == "held"
        return p
    yield hold
    for p in held:
        p.kill()
        p.wait()
