"""experiments/soak.py in its short form (CI): streaming clients with random disconnects
and hostile requests mixed in, against a live server, for half a minute; the server's
counts agree with the clients'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_soak(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "experiments" / "soak.py"), "--minutes", "0.5",
                        "--clients", "4", "--batch", "4", "--sample-s", "1", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert r.returncode == 0, (s["failures"], r.stderr[-2000:])
    n = s["requests"]
    assert n.get("error", 0) == 0, s["failures"]
    assert n["completed"] > 0 and n["disconnected"] > 0 and n["refused"] > 0, n
    assert s["served_after"] == 200
    # the server's own counts (/stats and /metrics) equal the clients': every disconnect
    # is one cancellation, every stream read to the end one completion
    assert s["counts"] == "agree", (s["server_counts"], s["client_counts"], s["metrics_counts"])
    assert s["server_counts"]["cancelled"] == n["disconnected"]
    assert 1 <= s["peak_rows"] <= 4
    # every row's KV was freed: MLX's live memory is back at its idle level (weights)
    assert s["mlx_active_idle_after_mb"] <= s["mlx_active_idle_before_mb"] + 1.0, s
    for f in ("samples.csv", "summary.md", "soak.png"):
        assert (tmp_path / f).stat().st_size > 0
