"""experiments/constrained_overhead.py end to end in a tiny configuration: every
library cell runs, llguidance enforces every schema of the coverage set (valid
accepted, invalid rejected), and both engine lanes report a per-token figure."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_constrained_overhead_quick(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "experiments" / "constrained_overhead.py"),
                        "--tokens", "8", "--reps", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "libraries.csv")))
    llg = [x for x in rows if x["library"] == "llguidance"]
    assert len(llg) == 24   # 12 schemas x 2 tokenizers
    assert all(x["compiles"] == x["accepts_valid"] == x["rejects_invalid"] == "True" for x in llg)
    summary = json.loads((tmp_path / "constrained_overhead.json").read_text())
    assert sorted(e["B"] for e in summary["engine"]) == [1, 8]
    assert all(e["constrained_us_per_token"] > 0 for e in summary["engine"])
