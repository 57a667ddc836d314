"""Soak: N streaming clients for T minutes against a live `engine-serve`, with random
disconnects and hostile requests mixed in, sampling the server's RSS and MLX memory.

    python3 experiments/soak.py [--minutes 10] [--clients 8] [--batch 4] [--tag cpu]
                                [--model DIR] [--memory-budget-gb GB] [--prompt-cache-mb 0]
                                [--out DIR]

The server runs in this process (a real uvicorn server on a thread, as in the tests),
so MLX's allocator counters (`mx.get_active_memory`, `mx.get_cache_memory`) are read
directly; RSS is this process's (/proc/self/status), clients included (their memory
is steady). Each client loops: a streamed request on a random protocol (chat,
completions, messages, responses) with random lengths, dropped after a random number
of chunks with probability --p-disconnect, or, with probability --p-hostile, one
hostile request from the catalogue (deep JSON, seed out of range, too many prompt
characters, a browser simple request, a foreign origin, malformed HTTP), which must
be refused with a 4xx. A stream its client will drop asks for --drop-tokens tokens
with the model's end tokens banned (`logit_bias`), so it is certainly still running
when its client leaves: then every client-side disconnect is one cancellation.
Responses turns are sent with `store: false` unless --store (the store is a bounded
cache that would otherwise grow to its cap: a slope, no leak); its size is sampled as
`store_mb`. The prompt cache is off unless --prompt-cache-mb (-1: engine-serve's default size).

Verdict: the slope of RSS and of MLX active memory over the second half of the run
(after warm-up), by least squares, in MB/min; "flat" when both are under --flat-mb-min.
Also checked: 0 errors (5xx, hangs, an unexpected status, an error inside a stream),
MLX active memory back to its idle level once the clients stop, and the server's own
counts (/stats `queue`, once it is idle) next to the clients': `counts` is "agree"
when its cancelled generations equal the clients' disconnects, its completed ones the
streams read to the end (plus the final check request), nothing failed, and /metrics
reports the same counters; `peak_rows` is the most rows that decoded together (at most
--batch). Writes samples.csv, summary.md, summary.json and soak.png to
reports/soak/<version>/<tag>/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from _common import machine, md_table, report_dir

# Imports: the standard library, httpx, numpy (slope), pandas (samples.csv), matplotlib
# (soak.png), mlx, and this repository's server with its runtime dependencies (fastapi,
# uvicorn, prometheus_client, tokenizers, ...); none of the test extras.

HOSTILE = ["deep_json", "seed", "prompt_chars", "text_plain", "origin", "malformed"]


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stream_request(rng: random.Random, n_tokens: int, store: bool = False, ban=None):
    """A streamed request on a random protocol; `ban`: a logit_bias (every protocol
    takes it) that keeps the end tokens out, so it runs to n_tokens."""
    kind = rng.choice(["chat", "completions", "messages", "responses"])
    text = f"soak {rng.randrange(10 ** 6)} " + "word " * rng.randrange(1, 200)
    extra = {"stream": True, **({"logit_bias": ban} if ban else {})}
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                        "max_tokens": n_tokens, **extra}
    if kind == "completions":
        return "/v1/completions", {"prompt": text, "max_tokens": n_tokens, **extra}
    if kind == "messages":
        return "/v1/messages", {"messages": [{"role": "user", "content": text}],
                                "max_tokens": n_tokens, **extra}
    return "/v1/responses", {"input": text, "max_output_tokens": n_tokens, "store": store,
                             **extra}


class Soak:
    def __init__(self, url: str, a, max_chars: int, ban: dict):
        self.url = url
        self.a = a
        self.max_chars = max_chars
        self.ban = ban
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.failures: list = []

    def note(self, key: str, failure: str = ""):
        with self.lock:
            self.counts[key] += 1
            if failure and len(self.failures) < 50:
                self.failures.append(failure)

    def client(self, i: int):
        rng = random.Random(self.a.seed * 1000 + i)
        with httpx.Client(base_url=self.url, timeout=self.a.hang_s) as http:
            while not self.stop.is_set():
                try:
                    if rng.random() < self.a.p_hostile:
                        self.hostile(http, rng)
                    else:
                        self.stream(http, rng)
                except httpx.TimeoutException as e:
                    self.note("error", f"hang: {e!r}")
                except httpx.HTTPError as e:
                    self.note("error", f"transport: {e!r}")

    def stream(self, http: httpx.Client, rng: random.Random):
        drop_after = rng.randrange(1, 8) if rng.random() < self.a.p_disconnect else None
        if drop_after is None:
            path, body = stream_request(rng, rng.randrange(4, 64), self.a.store)
        else:           # still running when its client leaves
            path, body = stream_request(rng, self.a.drop_tokens, self.a.store, self.ban)
        chunks = 0
        with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                self.note("error", f"{path} {r.status_code}: {r.text[:200]}")
                return
            for line in r.iter_lines():
                if line.startswith("data: {") and '"error"' in line[:40]:
                    self.note("error", f"{path} error frame: {line[:200]}")
                    return
                if line.startswith("event: error"):
                    self.note("error", f"{path} error event")
                    return
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    self.note("disconnected")
                    return
        self.note("completed")

    def hostile(self, http: httpx.Client, rng: random.Random):
        kind = rng.choice(HOSTILE)
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        if kind == "malformed":
            ok = self.raw_malformed()
            self.note("refused" if ok else "error", "" if ok else "malformed HTTP not refused")
            return
        hdrs = {"content-type": "application/json"}
        if kind == "deep_json":
            content = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        elif kind == "seed":
            content = json.dumps({**chat, "seed": rng.choice([-1, 2 ** 64]),
                                  "temperature": 0.5}).encode()
        elif kind == "prompt_chars":
            content = json.dumps({"prompt": "a" * (self.max_chars + 1)}).encode()
        elif kind == "text_plain":
            content, hdrs = json.dumps(chat).encode(), {"content-type": "text/plain"}
        else:
            content, hdrs = json.dumps(chat).encode(), {**hdrs, "Origin": "http://evil.example"}
        path = rng.choice(["/v1/chat/completions", "/v1/messages", "/v1/completions"])
        r = http.post(path, content=content, headers=hdrs)
        if 400 <= r.status_code < 500:
            self.note("refused")
        else:
            self.note("error", f"hostile {kind} on {path}: {r.status_code} {r.text[:200]}")

    def raw_malformed(self) -> bool:
        host, port = self.url.rsplit("/", 1)[-1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=self.a.hang_s) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Length: nope\r\n\r\n")
            return c.recv(4096).startswith(b"HTTP/1.1 400")


def slope_mb_per_min(t: list, y: list) -> float:
    import numpy as np
    if len(t) < 3:
        return float("nan")
    return float(np.polyfit(np.asarray(t) / 60.0, np.asarray(y) / 1e6, 1)[0])


def start_server(a):
    from server.app import create_app, security_for
    from server.cli import BackgroundServer
    from server.state import ServerConfig, build_state

    budget = a.memory_budget_gb
    if budget is None:   # the weights plus 2 GB of KV room, so a large model is not refused
        budget = 2.0 + (sum(f.stat().st_size for f in Path(a.model).glob("*.safetensors")) / 1e9
                        if a.model else 0.0)
    cfg = ServerConfig(model=a.model, batch=a.batch,
                       prompt_cache_bytes=None if a.prompt_cache_mb < 0 else a.prompt_cache_mb << 20,
                       memory_budget_bytes=int(budget * 1e9), max_tokens=64)
    state = build_state(cfg)
    app = create_app(state, security_for(cfg))
    return state, app, BackgroundServer(app, log_level="error").start()


SERVER_COUNTS = ("completed", "cancelled", "failed")


def wait_idle(url: str, limit_s: float) -> float:
    """Seconds until /stats shows nothing running or queued (the last clients' aborts
    land within a step of their leaving)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        q = httpx.get(url + "/stats", timeout=limit_s).json()["queue"]
        if q["active"] == 0 and q["queued"] == 0:
            break
        time.sleep(0.05)
    return round(time.monotonic() - t0, 3)


def metric_values(text: str, names) -> dict:
    """Unlabelled samples of a Prometheus exposition, by name."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            out[parts[0]] = float(parts[1])
    return out


def count_check(url: str, client: Counter, after_ok: bool) -> dict:
    """The server's counters (/stats, and /metrics) next to the clients' own counts."""
    stats = httpx.get(url + "/stats", timeout=30).json()
    q = stats["queue"]
    server = {k: q[k] for k in SERVER_COUNTS}
    names = {f"engine_generations_{k}_total": k for k in SERVER_COUNTS}
    scraped = metric_values(httpx.get(url + "/metrics", timeout=30).text, names)
    metrics = {names[n]: int(v) for n, v in scraped.items()}
    clients = {"disconnected": client["disconnected"],
               "completed": client["completed"] + int(after_ok)}   # + the final check
    agree = (server["cancelled"] == clients["disconnected"]
             and server["completed"] == clients["completed"] and server["failed"] == 0
             and metrics == server)
    return {"server_counts": server, "client_counts": clients, "metrics_counts": metrics,
            "counts": "agree" if agree else "disagree",
            "peak_rows": stats["batch"]["peak_rows"]}   # most rows decoding together


def plot(samples: list, out: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    fig, (ax, cx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    ax.plot(t, [s["rss_mb"] for s in samples], label="process RSS (MB)")
    ax.plot(t, [s["mlx_active_mb"] for s in samples], label="MLX active (MB)")
    ax.plot(t, [s["mlx_cache_mb"] for s in samples], label="MLX cache (MB)", alpha=0.6)
    ax.set_ylabel("MB")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    for key, label, style in (("disconnected", "client disconnects", "-"),
                              ("server_cancelled", "server cancelled", "--"),
                              ("completed", "client streams read to the end", "-"),
                              ("server_completed", "server completed", "--")):
        cx.plot(t, [s[key] for s in samples], style, label=label)
    cx.set_xlabel("minutes")
    cx.set_ylabel("requests (cumulative)")
    cx.legend(fontsize=8)
    cx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=120)
    plt.close(fig)


def run(a) -> dict:
    import mlx.core as mx

    state, app, bg = start_server(a)
    max_chars = app.state.security.limits.max_prompt_chars
    idle_active = mx.get_active_memory()
    ban = {str(t): -100 for t in state.tokenizer.eos_token_ids if 0 <= t < state.vocab_size}
    soak = Soak(bg.url, a, max_chars, ban)
    threads = [threading.Thread(target=soak.client, args=(i,), daemon=True)
               for i in range(a.clients)]
    samples, t0 = [], time.monotonic()
    for th in threads:
        th.start()
    try:
        while time.monotonic() - t0 < a.minutes * 60:
            g = state.gateway.stats()
            samples.append({"t_s": round(time.monotonic() - t0, 2),
                            "rss_mb": rss_bytes() / 1e6,
                            "mlx_active_mb": mx.get_active_memory() / 1e6,
                            "mlx_cache_mb": mx.get_cache_memory() / 1e6,
                            "store_mb": state.store.stats()["bytes"] / 1e6,
                            "rows_now": state.engine.stats()["rows_now"],
                            **{k: soak.counts[k] for k in
                               ("completed", "disconnected", "refused", "error")},
                            **{f"server_{k}": g[k] for k in SERVER_COUNTS}})
            time.sleep(a.sample_s)
    finally:
        soak.stop.set()
        for th in threads:
            th.join(a.hang_s + 10)
    idle_s = wait_idle(bg.url, a.hang_s)
    after = httpx.post(bg.url + "/v1/chat/completions", timeout=a.hang_s, json={
        "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    settle = state.gateway.call_sync(lambda: mx.get_active_memory())
    counts = count_check(bg.url, soak.counts, after.status_code == 200)
    bg.stop()
    state.gateway.close()
    half = [s for s in samples if s["t_s"] >= a.minutes * 30]
    summary = {
        "minutes": a.minutes, "clients": a.clients, "batch": a.batch,
        "requests": dict(soak.counts), "failures": soak.failures[:10],
        "served_after": after.status_code, "idle_after_s": idle_s, **counts,
        "rss_slope_mb_per_min": slope_mb_per_min([s["t_s"] for s in half],
                                                 [s["rss_mb"] * 1e6 for s in half]),
        "mlx_active_slope_mb_per_min": slope_mb_per_min(
            [s["t_s"] for s in half], [s["mlx_active_mb"] * 1e6 for s in half]),
        "mlx_active_idle_before_mb": idle_active / 1e6,
        "mlx_active_idle_after_mb": settle / 1e6,
        "rss_first_mb": samples[0]["rss_mb"] if samples else None,
        "rss_last_mb": samples[-1]["rss_mb"] if samples else None,
        "machine": machine(),
    }
    flat = all(abs(summary[k]) < a.flat_mb_min for k in
               ("rss_slope_mb_per_min", "mlx_active_slope_mb_per_min"))
    summary["verdict"] = "flat" if flat else "growing"
    summary["samples"] = samples
    return summary


def write(summary: dict, out: Path, argv: list):
    import pandas as pd

    samples = summary.pop("samples")
    pd.DataFrame(samples).to_csv(out / "samples.csv", index=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(samples, out, f"soak: {summary['clients']} clients, {summary['minutes']:g} min, "
                       f"batch {summary['batch']} - {summary['verdict']}")
    rows = [[k, json.dumps(v) if isinstance(v, (dict, list)) else
             (f"{v:.3f}" if isinstance(v, float) else v)]
            for k, v in summary.items() if k not in ("machine", "failures")]
    md = ["# Soak", "", f"`python3 experiments/soak.py {' '.join(argv)}`", "",
          md_table(["", "value"], rows), "", "![soak](soak.png)", "",
          f"machine: {json.dumps(summary['machine'])}", ""]
    if summary["failures"]:
        md += ["## Failures", ""] + [f"- `{f}`" for f in summary["failures"]]
    (out / "summary.md").write_text("\n".join(md) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--model", default=None, help="model dir (default: the built-in model)")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="the server's --memory-budget (GB; default: the model's weights + 2)")
    p.add_argument("--prompt-cache-mb", type=int, default=0,
                   help="prompt cache cap in MiB (0: off; -1: the server's default, a share of the budget)")
    p.add_argument("--store", action="store_true",
                   help="keep Responses turns (the store grows to its 32 MiB cap; off by "
                   "default so that a slope means a leak)")
    p.add_argument("--p-disconnect", type=float, default=0.3)
    p.add_argument("--p-hostile", type=float, default=0.15)
    p.add_argument("--drop-tokens", type=int, default=1024,
                   help="tokens a stream that its client will drop asks for (end tokens "
                   "banned): it is still running when the client leaves")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--hang-s", type=float, default=60.0)
    p.add_argument("--flat-mb-min", type=float, default=2.0,
                   help="slope under which memory counts as flat (MB/min)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default=None, help="output directory (default: reports/soak/...)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    summary = run(a)
    out = Path(a.out) if a.out else report_dir("soak", a.tag)
    out.mkdir(parents=True, exist_ok=True)
    write(summary, out, argv)
    print(json.dumps({k: v for k, v in summary.items() if k != "machine"}, indent=1))
    print(f"wrote {out}")
    ok = (summary["requests"].get("error", 0) == 0 and summary["served_after"] == 200
          and summary["counts"] == "agree")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
