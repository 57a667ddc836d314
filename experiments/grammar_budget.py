"""Hostile requests that used to stall the server, measured against a live engine-serve.

1. grammar: one request compiles a large schema (4,000 optional properties,
   under --max-schema-nodes) while /health is polled every 20 ms and another
   client streams; reports /health latency, the stream's longest gap and the
   hostile request's answer (a 400 past --max-grammar-ms, or its grammar error).
2. bodies: four 30 MB bodies of empty objects in an unknown field at once, while
   /health is polled and an innocent chat request runs; reports the server's RSS
   growth (peak over the run), /health latency and the innocent answer.

    python experiments/grammar_budget.py [--tag cpu]

Writes reports/grammar_budget/<version>/<tag>/report.json and README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import httpx

from _common import REPO, machine, md_table, report_dir
from served import Served


def lat(xs: list) -> dict:
    """/health latencies in ms: median, 99th percentile, max."""
    ms = sorted(1000 * x for x in xs)
    return {"p50": round(statistics.median(ms), 1), "p99": round(ms[int(0.99 * (len(ms) - 1))], 1),
            "max": round(ms[-1], 1), "polls": len(ms)}


def poll_health(url: str, stop: threading.Event, out: list) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(url + "/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


def stream_gaps(url: str, stop: threading.Event, out: dict) -> None:
    body = {"model": "m", "max_tokens": 400, "stream": True, "logit_bias": {"998": -100, "1000": -100},
            "messages": [{"role": "user", "content": "keep going"}]}
    last, gaps = None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as s:
        for _ in s.iter_lines():
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                break
    out["max_gap_s"] = max(gaps) if gaps else None
    out["chunks"] = len(gaps) + 1


def grammar_case(srv: Served) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}
    stop, health, stream = threading.Event(), [], {}
    th = [threading.Thread(target=poll_health, args=(srv.url, stop, health)),
          threading.Thread(target=stream_gaps, args=(srv.url, stop, stream))]
    for t in th:
        t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}})
    answer_s = time.perf_counter() - t0
    time.sleep(1.0)
    stop.set()
    for t in th:
        t.join(120)
    return {"hostile_status": r.status_code, "hostile_answer_s": round(answer_s, 3),
            "hostile_message": r.json().get("error", {}).get("message", "")[:160],
            "health_ms": lat(health), "stream_max_gap_ms": round(1000 * (stream.get("max_gap_s") or 0), 1),
            "stream_chunks": stream.get("chunks")}


def original_cases(srv: Served) -> list:
    """The payloads that used to compile for 12-17 s on the event loop: answer and time."""
    rows = []
    for name, schema in (
            ("10,000 optional properties", {"type": "object", "properties": {
                f"p{i}": {"type": "integer"} for i in range(10_000)}}),
            ("1,000,000-value enum", {"enum": list(range(1_000_000))})):
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "o", "schema": schema}}})
        rows.append({"case": name, "status": r.status_code,
                     "seconds": round(time.perf_counter() - t0, 3),
                     "message": r.json().get("error", {}).get("message", "")[:120]})
    return rows


def bodies_case(srv: Served, mb: int = 30, n: int = 4) -> dict:
    junk = b"{}," * (mb * (1 << 20) // 3)
    body = (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
            b'"junk": [' + junk + b'{}]}')
    rss0 = srv.rss_bytes()
    stop, health, peak = threading.Event(), [], [rss0]
    statuses, innocent = [], {}

    def hostile():
        r = httpx.post(srv.url + "/v1/chat/completions", content=body, timeout=120,
                       headers={"content-type": "application/json"})
        statuses.append(r.status_code)

    def sample():
        while not stop.is_set():
            peak.append(srv.rss_bytes())
            time.sleep(0.01)

    def innocent_req():
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]})
        innocent.update(status=r.status_code, seconds=round(time.perf_counter() - t0, 3))

    bg = [threading.Thread(target=poll_health, args=(srv.url, stop, health)),
          threading.Thread(target=sample)]
    for t in bg:
        t.start()
    work = [threading.Thread(target=hostile) for _ in range(n)] + [threading.Thread(target=innocent_req)]
    t0 = time.perf_counter()
    for t in work:
        t.start()
    for t in work:
        t.join(300)
    wall = time.perf_counter() - t0
    time.sleep(0.3)
    stop.set()
    for t in bg:
        t.join(60)
    return {"bodies": n, "body_mb": mb, "statuses": sorted(statuses), "wall_s": round(wall, 2),
            "rss_before_mb": round(rss0 / 2**20, 1),
            "rss_growth_peak_mb": round((max(peak) - rss0) / 2**20, 1),
            "health_ms": lat(health), "innocent": innocent}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="cpu")
    p.add_argument("--body-mb", type=int, default=30)
    a = p.parse_args(argv)
    from starter.models import ensure_fixture
    model = ensure_fixture("qwen3")
    with Served(REPO, ["--model", str(model), "--batch", "4"]) as srv:
        load0 = os.getloadavg()[0]
        res = {"machine": {**machine(), "cpus": os.cpu_count()},
               "grammar": grammar_case(srv), "bodies": bodies_case(srv, a.body_mb),
               "original": original_cases(srv),
               "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    out = report_dir("grammar_budget", a.tag)
    (out / "report.json").write_text(json.dumps(res, indent=2))
    g, b = res["grammar"], res["bodies"]
    (out / "README.md").write_text(
        "# Grammar compile and hostile bodies vs /health and other streams\n\n"
        f"Built-in qwen3 fixture, `--batch 4`, {res['machine']['device']}, "
        f"{res['machine']['cpus']} CPUs, 1-minute load average before/after "
        f"{res['load_average_1min']} (other work on the machine inflates the tails). "
        "`python experiments/grammar_budget.py`.\n\n"
        + md_table(["case", "hostile answer", "/health p50 / p99 / max (ms)", "other"], [
            ["schema of 4,000 optional properties", f"{g['hostile_status']} in "
             f"{g['hostile_answer_s']} s", "{p50} / {p99} / {max}".format(**g["health_ms"]),
             f"stream's longest gap {g['stream_max_gap_ms']} ms"],
            [f"{b['bodies']} x {b['body_mb']} MB of empty objects at once",
             f"{b['statuses']} in {b['wall_s']} s",
             "{p50} / {p99} / {max}".format(**b["health_ms"]),
             f"RSS growth {b['rss_growth_peak_mb']} MB; innocent {b['innocent']}"]])
        + "\n\nThe payloads that used to compile on the event loop:\n\n"
        + md_table(["schema", "status", "answered in (s)", "message"],
                   [[o["case"], o["status"], o["seconds"], o["message"]]
                    for o in res["original"]]) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
