"""Real agent clients against engine-serve: Claude Code, Codex CLI and OpenCode.

    python experiments/real_clients.py [--only claude-code,codex,opencode] [--timeout 300]

Installs the pinned npm packages (CLIENTS) under --clients-dir, starts
`python -m server.cli --model builtin:long` (the built-in long-context tiny model) on a
free loopback port with the access log on, runs one prompt with each client in a fresh
home and working directory, and checks, from the server's access log and /metrics, that
every API request the client made (`/v1/...`) got a 200, that the server logged no fault,
and that the client exited on its own with status 0 within the timeout. Other requests
(Claude Code's `HEAD /api/hello` connectivity probe, answered 404) are listed, not judged. The model's weights are random, so the clients
print gibberish: success here is protocol success.

Writes reports/real_clients/<engine version>/: results.json, results.md, server.log and
<client>.log (the client's stdout and stderr). Needs node/npm and the npm registry (the
install; OpenCode also fetches its provider package on first run), so it is not a CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import REPO, version  # noqa: E402

# name -> (npm package, pinned version, its binary)
CLIENTS = {"claude-code": ("@anthropic-ai/claude-code", "2.1.332", "claude"),
           "codex": ("@openai/codex", "0.171.0", "codex"),
           "opencode": ("opencode-ai", "1.18.33", "opencode")}
PROMPT = "Say hello"
MODEL = "builtin:long"
ACCESS = re.compile(r'"(GET|POST|HEAD|PUT|DELETE|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')
READY = re.compile(r"engine-serve ready: (http://\S+)")


def install(prefix: Path, names: list) -> dict:
    """npm install of the pinned packages (skipped when the installed versions match)."""
    prefix.mkdir(parents=True, exist_ok=True)
    want = [f"{CLIENTS[n][0]}@{CLIENTS[n][1]}" for n in names]
    have = {}
    for n in names:
        pj = prefix / "node_modules" / CLIENTS[n][0] / "package.json"
        have[n] = json.loads(pj.read_text())["version"] if pj.exists() else None
    if any(have[n] != CLIENTS[n][1] for n in names):
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        *want], check=True, timeout=900)
    return {n: str(prefix / "node_modules" / ".bin" / CLIENTS[n][2]) for n in names}


def start_server(log_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = open(log_path, "w")
    p = subprocess.Popen([sys.executable, "-m", "server.cli", "--model", MODEL, "--port", "0",
                          "--access-log", "--log-level", "info"], cwd=REPO, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        m = READY.search(log_path.read_text())
        if m:
            return p, m.group(1)
        if p.poll() is not None:
            raise SystemExit(f"engine-serve exited ({p.returncode}):\n{log_path.read_text()}")
        time.sleep(0.5)
    p.terminate()
    raise SystemExit("engine-serve did not become ready in 600 s")


def setup(name: str, url: str, home: Path, work: Path) -> tuple:
    """(argv after the binary, extra environment) of one client pointed at `url`."""
    if name == "claude-code":
        return ["-p", PROMPT], {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "x"}
    if name == "codex":
        cfg = home / ".codex"
        cfg.mkdir(parents=True)
        (cfg / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "engine"\n\n[model_providers.engine]\n'
            f'name = "engine-serve"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
        return ["exec", "--skip-git-repo-check", PROMPT], {"CODEX_HOME": str(cfg)}
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"engine": {"npm": "@ai-sdk/openai-compatible", "name": "engine-serve",
                                "options": {"baseURL": f"{url}/v1", "apiKey": "x"},
                                "models": {MODEL: {"name": MODEL}}}},
        "model": f"engine/{MODEL}"}, indent=2))
    return ["run", "-m", f"engine/{MODEL}", PROMPT], {
        "XDG_CONFIG_HOME": str(home / ".config"), "OPENCODE_CONFIG": str(work / "opencode.json")}


COUNTERS = ("engine_requests_total{", "engine_prompt_tokens_total{",
            "engine_generation_tokens_total{")


def metrics(url: str) -> dict:
    """The server's request and token counters (by protocol) from /metrics."""
    import httpx
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(COUNTERS):
            key, val = line.rsplit(" ", 1)
            out[key] = float(val)
    return out


def run_client(name: str, binary: str, url: str, server_log: Path, out: Path,
               timeout: float) -> dict:
    pkg, ver, _ = CLIENTS[name]
    with tempfile.TemporaryDirectory(prefix=f"rc-{name}-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        args, extra = setup(name, url, home, work)
        env = {**os.environ, "HOME": str(home), "NO_COLOR": "1", **extra}
        before_log, before_metrics = len(server_log.read_text()), metrics(url)
        t0 = time.time()
        try:
            p = subprocess.run([binary, *args], cwd=work, env=env, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=timeout)
            code, stdout, stderr, timed_out = p.returncode, p.stdout, p.stderr, False
        except subprocess.TimeoutExpired as e:
            code, timed_out = None, True
            stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            stderr = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        seconds = round(time.time() - t0, 1)
    time.sleep(1.0)                      # the last access-log lines
    new = server_log.read_text()[before_log:]
    requests = [{"method": m, "path": p, "status": int(s)} for m, p, s in ACCESS.findall(new)
                if (m, p) != ("GET", "/metrics")]          # (this script's own scrapes)
    api = [r for r in requests if r["path"].startswith("/v1/")]
    after = metrics(url)
    delta = {k: after[k] - before_metrics.get(k, 0.0) for k in after
             if after[k] != before_metrics.get(k, 0.0) and 'protocol="other"' not in k}
    faults = [line for line in new.splitlines() if "Traceback" in line or " ERROR" in line]
    (out / f"{name}.log").write_text(f"$ {Path(binary).name} {' '.join(args)}\n"
                                     f"exit: {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    ok = (not timed_out and code == 0 and bool(api)
          and all(r["status"] == 200 for r in api) and not faults)
    return {"client": name, "package": pkg, "version": ver, "exit_code": code,
            "timed_out": timed_out, "seconds": seconds, "requests": requests,
            "api_requests": len(api), "api_all_200": all(r["status"] == 200 for r in api),
            "metrics_delta": delta, "server_faults": faults, "ok": ok,
            "stdout_tail": stdout.strip()[-300:]}


def write_report(out: Path, results: list, url: str) -> None:
    (out / "results.json").write_text(json.dumps({"engine": version(), "model": MODEL,
                                                  "prompt": PROMPT, "results": results},
                                                 indent=2))
    lines = [f"# Real agent clients against engine-serve {version()}", "",
             f"`python -m server.cli --model {MODEL}`; one prompt (\"{PROMPT}\") per client; "
             "`experiments/real_clients.py`.", "",
             "| client | version | exit | seconds | API requests (status) | prompt tokens | "
             "generated tokens | other requests | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        api = ", ".join(f"{q['method']} {q['path']} {q['status']}" for q in r["requests"]
                        if q["path"].startswith("/v1/"))
        other = ", ".join(f"{q['method']} {q['path']} {q['status']}" for q in r["requests"]
                          if not q["path"].startswith("/v1/")) or "-"
        code = "timeout" if r["timed_out"] else r["exit_code"]
        tokens = [int(sum(v for k, v in r["metrics_delta"].items() if k.startswith(c)))
                  for c in COUNTERS[1:]]
        lines.append(f"| {r['client']} | {r['package']}@{r['version']} | {code} | "
                     f"{r['seconds']} | {api or '-'} | {tokens[0]} | {tokens[1]} | {other} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CLIENTS), help="clients to run (comma list)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per client")
    ap.add_argument("--clients-dir", type=Path,
                    default=Path.home() / ".cache" / "mlx-parity" / "agent-clients",
                    help="npm prefix the clients are installed under")
    ap.add_argument("--out", type=Path, default=None,
                    help="report directory (default reports/real_clients/<version>)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        ap.error(f"unknown client(s) {unknown}; have {list(CLIENTS)}")
    out = args.out or REPO / "reports" / "real_clients" / version()
    out.mkdir(parents=True, exist_ok=True)
    bins = install(args.clients_dir, names)
    server_log = out / "server.log"
    proc, url = start_server(server_log)
    results = []
    try:
        for n in names:
            r = run_client(n, bins[n], url, server_log, out, args.timeout)
            print(f"{n} {r['version']}: exit {r['exit_code']}, {r['api_requests']} API "
                  f"requests, all 200: {r['api_all_200']}, {r['seconds']} s -> "
                  f"{'ok' if r['ok'] else 'FAILED'}", flush=True)
            results.append(r)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    write_report(out, results, url)
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
