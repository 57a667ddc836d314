"""Hops of one streamed chat request: the project's own call frames from the HTTP
handler to the model's forward pass, and from the forward's output back to the SSE
bytes, recorded with a profiler (not counted by hand).

    python -m experiments.hop_count                      # this tree
    python -m experiments.hop_count --compare ../other   # also another checkout, side by side

A hop is one call frame in `engine/` or `server/` (model internals excluded; the
model's own `__call__` is the last hop of the way in). Measured with `--batch 1`
(a request runs solo) and `--batch 4` (a request runs as a batch row). The
request crosses a thread (event loop -> model worker) and back, so each direction is
two stacks: the event loop's up to the hand-off, and the worker's from its loop. The
report (`reports/hop_count/<version>/<tag>/`) lists every hop as `file:function`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _frames(frame, root: str) -> list:
    out = []
    while frame is not None:
        f = frame.f_code.co_filename
        if f.startswith(root) and ("/engine/" in f or "/server/" in f):
            out.append(f"{os.path.relpath(f, root)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


def measure(root: str, fixture_dir: str, batch: int, tier: str = "l1") -> dict:
    """Run one streamed chat request against a server built from `root` (first on
    sys.path before anything of the project is imported); return the stacks."""
    import httpx
    from server.app import create_app
    from server.cli import BackgroundServer
    from server.state import ServerConfig, build_state

    root = os.path.join(os.path.realpath(root), "")
    seen: dict = {}
    armed = threading.Event()

    def prof(frame, event, arg):
        if event != "call" or not armed.is_set():
            return
        code = frame.f_code
        f, name = code.co_filename, code.co_name
        if not f.startswith(root):
            return
        rel = os.path.relpath(f, root)
        if name == "__call__" and rel.startswith("engine/models/") and tier == "l1":
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            if "/engine/models/" not in caller:
                seen["forward"] = _frames(frame, root)
        elif name == "__call__" and rel == "engine/fast/decode.py" and "forward" not in seen:
            seen["forward"] = _frames(frame, root)     # (the fast runner's step, in place of
            #                                             the forward: --tier l3)
        elif rel == "server/gateway.py" and name == "submit" and "to_worker" not in seen:
            seen["to_worker"] = _frames(frame, root)
        elif rel == "server/gateway.py" and name == "put" and "forward" in seen \
                and "from_worker" not in seen:
            seen["from_worker"] = _frames(frame, root)
        elif rel == "server/sse.py" and name in ("dumps", "data") and "forward" in seen \
                and "to_bytes" not in seen:
            stack = _frames(frame, root)
            if any(h.endswith(":feed") for h in stack):     # a content chunk, not the head
                seen["to_bytes"] = stack

    threading.setprofile(prof)
    sys.setprofile(prof)
    levers = None
    if tier != "l1":
        from engine.levers import resolve
        levers = resolve(tier, env={})
    state = build_state(ServerConfig(model=fixture_dir, prompt_cache_bytes=0, batch=batch,
                                     levers=levers))
    bg = BackgroundServer(create_app(state)).start()
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "temperature": 0, "stream": True}
        httpx.post(bg.url + "/v1/chat/completions", json=body, timeout=60)   # warm-up
        seen.clear()
        armed.set()
        r = httpx.post(bg.url + "/v1/chat/completions", json=body, timeout=60)
        armed.clear()
        assert r.status_code == 200, r.text
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        bg.stop()
        state.gateway.close()
    fwd = seen["to_worker"] + seen["forward"]
    back = seen["from_worker"] + seen["to_bytes"]
    files = {h.split(":")[0] for h in fwd + back}
    return {"root": root, "batch": batch, "tier": tier, "to_forward": len(fwd), "back_to_sse": len(back), "files": len(files),
            "stacks": seen}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(HERE), help="checkout to measure")
    ap.add_argument("--compare", default=None, help="another checkout, measured the same way")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--batch", type=int, default=1, help="(internal) the server's --batch")
    ap.add_argument("--json", default=None, help="(internal) measure with this fixture dir")
    ap.add_argument("--tier", default="l1", help="(internal) the server's tier")
    a = ap.parse_args(argv)
    if a.json:
        sys.path.insert(0, a.root)
        print(json.dumps(measure(a.root, a.json, a.batch, a.tier)))
        return 0
    sys.path.insert(0, str(HERE))
    from starter.models import ensure_fixture
    fixture = str(ensure_fixture("qwen3", "bfloat16"))
    rows = []
    for root in [a.compare, a.root] if a.compare else [a.root]:
        for batch, tier in ((1, "l1"), (4, "l1"), (4, "l3")):
            env = dict(os.environ, PYTHONPATH=root)
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json",
                                  fixture, "--root", root, "--batch", str(batch), "--tier", tier],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    import pandas as pd
    from experiments._common import report_dir
    table = pd.DataFrame([{k: r.get(k, "l1") for k in ("root", "batch", "tier", "to_forward",
                                                        "back_to_sse", "files")}
                          for r in rows])
    d = report_dir("hop_count", a.tag)
    lines = ["# Hops of one streamed chat request", "",
             "Command: `python -m experiments.hop_count" +
             (f" --compare {a.compare}" if a.compare else "") + "`", "",
             "```", table.to_string(index=False), "```", ""]
    for r in rows:
        lines.append(f"## {r['root']} --batch {r['batch']} --tier {r.get('tier', 'l1')}")
        for k in ("to_worker", "forward", "from_worker", "to_bytes"):
            lines += ["", f"{k}:", ""] + [f"{i + 1}. `{h}`" for i, h in enumerate(r["stacks"][k])]
        lines.append("")
    (d / "hops.md").write_text("\n".join(lines))
    (d / "hops.json").write_text(json.dumps(rows, indent=1))
    print(table.to_string(index=False))
    print(f"report: {d / 'hops.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
