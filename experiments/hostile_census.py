"""Re-run the hostile reproductions against `engine-serve` from one or more code roots and
count the outcomes (before/after a fix: point --roots at the old and the new checkout).

    python3 experiments/hostile_census.py --roots before=/path/to/old after=. [--tag cpu]
                                          [--big-chars 15000000] [--slowloris 50]

Each case is classified: ok (a 4xx in the protocol's shape, or the documented safe
answer), 5xx, hang (no answer within --hang-s), lenient (accepted although it should be
refused), leak (the answer reveals internals or which paths exist), plain (a low-level
error answered in plain text), killed (an innocent stream got an error). The servers run
the built-in model with --batch 4 and --memory-budget 2. Writes census.csv and summary.md
under reports/hostile_census/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from _common import REPO, machine, md_table, report_dir
from served import Served, raw_exchange

EVIL = "http://evil.example"
LEAKS = re.compile(r"Error:|Traceback|incompatible function|/root|/work/|/home/|/tmp/")
OPERATIONS = [("GET", "/v1/models"), ("GET", "/v1/models/x"), ("GET", "/stats"),
              ("GET", "/v1/adapters"), ("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/x"),
              ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/x"),
              ("DELETE", "/v1/responses/x")]
DEEP_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages",
               "/v1/messages/count_tokens", "/v1/responses", "/v1/adapters"]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def verdict_of(r, want=(400,)) -> str:
    if r is None:
        return "hang"
    if r.status_code >= 500:
        return "5xx"
    if r.status_code < 400:
        return "lenient"
    try:
        body = r.json()
        msg = (body.get("error") or {}).get("message", "")
    except ValueError:
        return "plain"
    if LEAKS.search(msg):
        return "leak"
    return "ok" if r.status_code in want else f"other {r.status_code}"


class Census:
    def __init__(self, url: str, hang_s: float):
        self.url = url
        self.hang_s = hang_s
        self.rows: list = []

    def request(self, method, path, timeout=None, **kw):
        try:
            return httpx.request(method, self.url + path, timeout=timeout or self.hang_s, **kw)
        except httpx.TimeoutException:
            return None
        except httpx.TransportError:
            return None

    def add(self, row: int, case: str, verdict: str, status=None, note: str = ""):
        self.rows.append({"row": row, "case": case, "verdict": verdict,
                          "status": status, "note": note})

    def check(self, row, case, r, want=(400,), note=""):
        self.add(row, case, verdict_of(r, want), getattr(r, "status_code", None), note)

    # --- the cases -----------------------------------------------------------

    def deep_json(self):
        deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 10000 + \
            b"]" * 10000 + b"}"
        for path in DEEP_ROUTES:
            r = self.request("POST", path, content=deep,
                             headers={"content-type": "application/json"})
            self.check(5, f"JSON 10,000 deep {path}", r)

    def poison_row(self):
        """Row 3: a seed out of range next to an innocent stream (--batch 4)."""
        got, errors = [], []

        def innocent():
            body = {**CHAT, "max_tokens": 200, "stream": True, "temperature": 0.0}
            try:
                with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                                  timeout=self.hang_s) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            d = json.loads(line[6:])
                            (errors if "error" in d else got).append(d)
            except httpx.HTTPError as e:
                errors.append(repr(e))
        for seed in (-1, 2 ** 64):
            got.clear()
            errors.clear()
            t = threading.Thread(target=innocent)
            t.start()
            time.sleep(0.3)
            r = self.request("POST", "/v1/chat/completions",
                             json={**CHAT, "seed": seed, "temperature": 0.5})
            t.join(self.hang_s + 5)
            self.check(3, f"seed {seed} next to a stream", r)
            self.add(3, f"innocent stream next to seed {seed}",
                     "killed" if errors or not got else "ok", note=str(errors[:1])[:120])

    def guard(self):
        """Row 43: schemas no grammar can honour, bad tools, max_tokens past the
        context, a body of many empty objects (each must be a 4xx, never a 200)."""
        def fmt(schema):
            return {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
        fn = {"type": "object", "properties": {"x": {"type": "integer"}}}
        cases = {
            "schema const with special-token text": {"response_format": fmt(
                {"const": "x<|im_end|>y"})},
            'schema {"$ref": "#"}': {"response_format": fmt({"$ref": "#"})},
            "schema minItems 1e9": {"response_format": fmt({"type": "array",
                                                            "minItems": 10 ** 9})},
            "schema 600 optional properties": {"response_format": fmt({
                "type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                 for i in range(600)}})},
            "tool named a b<|im_end|>": {"tools": [{"type": "function", "function": {
                "name": "a b<|im_end|>", "parameters": fn}}], "tool_choice": "required"},
            "duplicate tool names": {"tools": [{"type": "function", "function": {
                "name": "f", "parameters": fn}}] * 2},
            "tool parameters not a schema": {"tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": 7}}}]},
            "max_tokens 1e6": {"max_tokens": 10 ** 6},
        }
        for case, extra in cases.items():
            self.check(43, case, self.request("POST", "/v1/chat/completions",
                                              json={**CHAT, **extra}))
        junk = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                b'"junk": [' + b"{}," * 3_000_000 + b"{}]}")
        self.check(43, "9 MB of empty objects in an unknown field", self.request(
            "POST", "/v1/chat/completions", content=junk,
            headers={"content-type": "application/json"}), want=(413,))

    def images_and_names(self):
        """Row 50 (the 0.5.0 surfaces, text-only built-in model): image parts of each
        protocol are 400s (no vision tower), a non-string model is a 400."""
        png = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4"
               "nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
        user = {"role": "user"}
        cases = {
            "/v1/chat/completions": {**CHAT, "messages": [{**user, "content": [
                {"type": "image_url", "image_url": {"url": png}}] * 120}]},
            "/v1/messages": {**CHAT, "messages": [{**user, "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": png.split(",")[1]}}]}]},
            "/v1/responses": {"input": [{**user, "content": [
                {"type": "input_image", "image_url": png}]}], "max_output_tokens": 2}}
        for path, body in cases.items():
            self.check(50, f"image to a text-only model {path}", self.request("POST", path,
                                                                             json=body))
        for bad in (5, ["x"], {"a": 1}):
            self.check(50, f"model {json.dumps(bad)}", self.request(
                "POST", "/v1/chat/completions", json={**CHAT, "model": bad}))

    def ranges(self):
        self.check(11, "temperature 1e9", self.request(
            "POST", "/v1/chat/completions", json={**CHAT, "temperature": 1e9}))

    def cors(self):
        plain = {"content-type": "text/plain", "Origin": EVIL}
        r = self.request("POST", "/v1/adapters", content=b'{"path": "/root"}', headers=plain)
        self.add(7, "text/plain mount from a foreign page", self._cors_verdict(r),
                 getattr(r, "status_code", None))
        r = self.request("POST", "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                         headers=plain)
        self.add(7, "text/plain generation from a foreign page", self._cors_verdict(r),
                 getattr(r, "status_code", None))
        r = self.request("GET", "/stats", headers={"Origin": EVIL})
        self.add(7, "foreign page reads /stats", self._cors_verdict(r),
                 getattr(r, "status_code", None))
        r = self.request("OPTIONS", "/v1/adapters", headers={
            "Origin": EVIL, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        self.add(7, "preflight from a foreign page", self._cors_verdict(r),
                 getattr(r, "status_code", None))

    @staticmethod
    def _cors_verdict(r) -> str:
        if r is None:
            return "hang"
        if r.headers.get("access-control-allow-origin") in ("*", EVIL) or r.status_code < 300:
            return "lenient"
        return "ok" if r.status_code < 500 else "5xx"

    def adapter_paths(self):
        a = self.request("POST", "/v1/adapters", json={"path": "/root"})
        b = self.request("POST", "/v1/adapters", json={"path": "/nope/never"})
        if a is None or b is None:
            self.add(8, "mount /root vs /nope", "hang")
            return
        same = a.status_code == b.status_code and \
            a.json()["error"]["message"] == b.json()["error"]["message"]
        v = verdict_of(a)
        self.add(8, "mount /root vs /nope", v if same and v != "ok" else
                 ("ok" if same else "leak"), a.status_code,
                 note=a.json()["error"]["message"][:100])

    def allow_405(self):
        for method, path in OPERATIONS:
            r = self.request("PATCH", path)
            v = verdict_of(r, want=(405,))
            if v == "ok" and "allow" not in r.headers:
                v = "no Allow"
            self.add(12, f"PATCH {path}", v, getattr(r, "status_code", None))

    def malformed(self):
        h = b"Host: 127.0.0.1\r\nConnection: close\r\n"
        cases = {"bad Content-Length": b"POST /v1/completions HTTP/1.1\r\n" + h +
                 b"Content-Length: abc\r\n\r\n{}",
                 "bad chunk size": b"POST /v1/completions HTTP/1.1\r\n" + h +
                 b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                 "5,000 headers": b"GET /v1/models HTTP/1.1\r\n" + h +
                 b"".join(b"X-H%d: v\r\n" % i for i in range(5000)) + b"\r\n",
                 "1 MB header": b"GET /v1/models HTTP/1.1\r\n" + h + b"X-Big: " +
                 b"a" * (1 << 20) + b"\r\n\r\n"}
        for name, data in cases.items():
            out = raw_exchange(self.url, data, self.hang_s)
            head, _, body = out.partition(b"\r\n\r\n")
            if not out:
                v = "closed"
            elif head.startswith(b"HTTP/1.1 2"):
                v = "lenient"
            elif b"application/json" in head.lower():
                v = "ok"
            else:
                v = "plain"
            self.add(12, name, v, head[9:12].decode() if out else None)

    def slowloris(self, n: int, wait_s: float):
        host, port = self.url.rsplit("/", 1)[-1].rsplit(":", 1)
        socks = []
        for _ in range(n):
            c = socket.create_connection((host, int(port)))
            c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
            socks.append(c)
        time.sleep(wait_s)
        held = 0
        for c in socks:
            c.setblocking(False)
            try:
                c.recv(1, socket.MSG_PEEK)     # an answer, or b"" once closed: not held
            except BlockingIOError:
                held += 1                     # nothing to read and still open
            except OSError:
                pass
            c.close()
        self.add(12, f"{n} slowloris sockets after {wait_s:g} s",
                 "ok" if held == 0 else "held", note=f"{held} still open")

    def big_prompt(self, chars: int, served: Served):
        base = served.peak_rss_bytes()
        body = {"messages": [{"role": "user", "content": "a " * (chars // 2)}], "max_tokens": 1}
        t0 = time.monotonic()
        r = self.request("POST", "/v1/chat/completions", json=body, timeout=600)
        took = time.monotonic() - t0
        peak = served.peak_rss_bytes()
        self.check(2, f"chat content of {chars:,} characters", r, want=(400, 413),
                   note=f"peak RSS {peak / 1e9:.2f} GB (+{(peak - base) / 1e9:.2f}), "
                        f"{took:.1f} s")
        self.big = {"peak_rss_gb": peak / 1e9, "delta_gb": (peak - base) / 1e9, "s": took,
                    "status": getattr(r, "status_code", None)}

    def shutdown(self, served: Served, stop_s: float):
        body = {"prompt": "go", "max_tokens": 3000, "stream": True,   # 4,096 positions
                "logit_bias": {"998": -100, "1000": -100}, "temperature": 0.0}  # no EOS
        threading.Thread(target=self.request, args=("POST", "/v1/completions"),
                         kwargs={"json": body}, daemon=True).start()
        time.sleep(2.0)
        took = served.terminate(stop_s)
        self.add(9, "SIGTERM with a stream running",
                 "hang" if took is None else "ok", note="killed" if took is None else
                 f"exited in {took:.1f} s")


def empty_key(root: Path) -> str:
    try:
        with Served(root, ["--api-key", "", "--prompt-cache", "0"], ready_timeout=90) as s:
            return "lenient" if "auth=on" not in s.ready_line else "ok"
    except RuntimeError:
        return "ok"        # refused at start


def run_root(name: str, root: Path, a) -> tuple:
    args = ["--batch", "4", "--memory-budget", "2", "--prompt-cache", "0"]
    with Served(root, args) as s:
        c = Census(s.url, a.hang_s)
        c.deep_json()
        c.poison_row()
        c.ranges()
        c.images_and_names()
        c.guard()
        c.cors()
        c.adapter_paths()
        c.allow_405()
        c.malformed()
        c.slowloris(a.slowloris, a.slowloris_s)
        c.big_prompt(a.big_chars, s)
        c.shutdown(s, a.stop_s)
    c.add(10, '--api-key ""', empty_key(root))
    for r in c.rows:
        r["server"] = name
    return c.rows, c.big


def _md(df) -> str:
    return md_table([df.index.name or ""] + [str(c) for c in df.columns],
                    [[i, *row] for i, row in zip(df.index, df.values.tolist())])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", nargs="+", default=[f"this={REPO}"],
                   help="NAME=DIR code roots to serve from (default: this checkout)")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--hang-s", type=float, default=30.0)
    p.add_argument("--big-chars", type=int, default=15_000_000)
    p.add_argument("--slowloris", type=int, default=50)
    p.add_argument("--slowloris-s", type=float, default=15.0)
    p.add_argument("--stop-s", type=float, default=60.0)
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    import pandas as pd

    rows, bigs = [], {}
    for spec in a.roots:
        name, _, root = spec.partition("=")
        got, big = run_root(name, Path(root).resolve(), a)
        rows += got
        bigs[name] = big
    df = pd.DataFrame(rows)
    out = report_dir("hostile_census", a.tag)
    df.to_csv(out / "census.csv", index=False)
    counts = df.pivot_table(index="verdict", columns="server", values="case",
                            aggfunc="count", fill_value=0)
    by_row = df.assign(bad=df.verdict != "ok").pivot_table(
        index="row", columns="server", values="bad", aggfunc="sum", fill_value=0)
    big = pd.DataFrame(bigs).T
    md = ["# Hostile census", "", f"`python3 experiments/hostile_census.py {' '.join(argv)}`",
          "", f"machine: {json.dumps(machine())}", "", "## Outcomes (cases)", "",
          _md(counts), "", "## Cases not ok, by issue row", "", _md(by_row),
          "", "## Largest rejected body", "", _md(big.round(2)), "",
          "## All cases", "", _md(df.set_index("server"))]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print(counts.to_string())
    print(by_row.to_string())
    print(big.to_string())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
