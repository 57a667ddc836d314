"""Importing the L2 oracle (mlx-optiq) must not replace mlx-lm's oracles.

`import optiq` swaps its own MiniCPM5 tool parser into `mlx_lm.tool_parsers`
unless mlx-lm's is already loaded; `parity.oracles.optiq_oracle` guards that.
Run in a fresh interpreter: in this process the modules may already be loaded
in a lucky order, which would hide a regression.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import parity.oracles.optiq_oracle  # imports optiq
import optiq  # noqa: F401
from mlx_lm.tool_parsers import minicpm5
print(minicpm5.__name__, minicpm5.__file__)
r = minicpm5.parse_tool_call('<function name="f"><param name="x">1</param></function>')
print(type(r).__name__)
"""


def test_optiq_import_keeps_mlx_lm_minicpm5_parser():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    name_line, type_line = out.stdout.strip().splitlines()[-2:]
    assert "mlx_lm/tool_parsers/minicpm5.py" in name_line.replace("\\", "/"), name_line
    assert type_line == "dict", type_line
