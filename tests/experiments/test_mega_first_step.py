"""experiments/mega_first_step.py: a model that does not load is a message and exit status 2."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_missing_model_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "mega_first_step.py"), "--model",
                        str(tmp_path / "none"), "--env", "MLXP_MEGA_QKNORM=0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "no such directory" in r.stderr and "Traceback" not in r.stderr
