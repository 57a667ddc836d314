"""Why do concurrent requests wait for their first token? One engine-serve, N streaming clients.

Starts `engine-serve --model DIR --batch N --prompt-cache 0 [--ours-args]`, sends a warm-up
round (N concurrent requests of 8 tokens) and then a timed round (N concurrent requests of
--gen tokens), each streaming; prints each request's time to first token and to its end, and
`/stats` (the fast runner's traces, the batch counters) before and after the timed round, and
the server log's tail.

    python experiments/stall_probe.py --model DIR [--clients 16] [--gen 128] [--ours-args "--tier l3"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from experiments.bench_server import Server, free_port  # noqa: E402


def one(client, url, prompt, gen, out, i, go):
    body = {"model": "m", "prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True}
    first = None
    go.wait()
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and first is None and '"text"' in line:
                first = time.perf_counter() - t0
    out[i] = {"ttft_s": round(first or -1, 3), "end_s": round(time.perf_counter() - t0, 3)}


def round_(url, prompts, gen):
    """Every client made (and its thread started) before the requests go out together."""
    out = [None] * len(prompts)
    clients = [httpx.Client(timeout=300) for _ in prompts]
    go = threading.Event()
    ts = [threading.Thread(target=one, args=(clients[i], url, p, gen, out, i, go))
          for i, p in enumerate(prompts)]
    for t in ts:
        t.start()
    time.sleep(0.2)
    go.set()
    for t in ts:
        t.join()
    for c in clients:
        c.close()
    return out


def stats(url):
    s = httpx.get(url + "/stats", timeout=30).json()
    lv = s.get("levers", {})
    return {"fast_stats": lv.get("fast_stats"), "batch": s.get("batch"), "queue": s.get("queue")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--ours-args", default="--tier l3")
    a = ap.parse_args(argv)
    import engine
    _, tok = engine.load(a.model)
    rng = np.random.default_rng(0)
    port = free_port()
    argv_ = [sys.executable, "-m", "server.cli", "--model", a.model, "--port", str(port), "--batch",
             str(a.clients), "--prompt-cache", "0", *shlex.split(a.ours_args)]
    s = Server("engine-serve", argv_, port, None)
    s.wait()
    url = f"http://127.0.0.1:{port}"
    try:
        mk = lambda: [tok.decode(rng.integers(32, 1000, a.prompt).tolist()) for _ in range(a.clients)]  # noqa: E731
        print(json.dumps({"warm": round_(url, mk(), 8)}))
        print(json.dumps({"before": stats(url)}))
        print(json.dumps({"timed": round_(url, mk(), a.gen)}))
        print(json.dumps({"after": stats(url)}))
    finally:
        s.stop()
        s.log.seek(0)
        print("--- server log tail ---\n" + s.log.read()[-2500:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
