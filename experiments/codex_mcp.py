"""Codex CLI calls an MCP server's tool through engine-serve (namespace tools, end to end).

    python experiments/codex_mcp.py [--clients-dir DIR] [--timeout 300]

Codex sends each MCP server's tools as a `namespace` tool and routes a `function_call` by its
`namespace` and `name`. The model here is the Qwen-format long-context test fixture with its
output scripted (tests/server/srv_helpers.py's ForcedModel): a request carrying an MCP
namespace and no tool output yet is answered with a call of that namespace's first tool
(`{"text": "hi"}`), any other with "Done.". A stdio MCP server written for the run exposes
`echo(text)`. Checked: Codex sent the MCP tool as a namespace; our answer's call carried
`namespace` and `name`; the MCP server ran `echo`; Codex sent the call back as history with
its `namespace`; every request got a 200; Codex exited 0. Needs node/npm (the pinned Codex of
experiments/real_clients.py), so it is not a CI test.

Writes reports/real_clients/<engine version>/codex-mcp/: results.json, results.md,
requests.jsonl (each request: path, status, its tools' types and names, the calls answered),
mcp.log and codex.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))

from experiments._common import REPO, version  # noqa: E402
from experiments.real_clients import install  # noqa: E402

MCP_SERVER = r'''
import json, sys
log = open(sys.argv[1], "a", buffering=1)
def send(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    if not line.strip():
        continue
    m = json.loads(line); mid, meth = m.get("id"), m.get("method")
    log.write(json.dumps({"method": meth, "params": m.get("params")}) + "\n")
    if mid is None:
        continue
    if meth == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": m.get("params", {}).get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}}, "serverInfo": {"name": "demo", "version": "0.1"}}})
    elif meth == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [{
            "name": "echo", "description": "Echo the given text back.",
            "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}},
                            "required": ["text"]}}]}})
    elif meth == "tools/call":
        text = (m["params"].get("arguments") or {}).get("text")
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "content": [{"type": "text", "text": f"echo: {text}"}], "isError": False}})
    else:
        send({"jsonrpc": "2.0", "id": mid, "result": {}} if meth == "ping" else
             {"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": str(meth)}})
'''


def serve(log: list):
    """A forced-model engine-serve (in this process) whose requests and answers go to `log`."""
    from parity.fixtures.models import ensure_fixture
    from server.app import create_app, security_for
    from server.listen import BackgroundServer
    from server.state import ServerConfig, build_state
    from srv_helpers import ForcedModel

    cfg = ServerConfig(model=str(ensure_fixture("qwen3", "bfloat16", variant="long")), batch=1)
    state = build_state(cfg, wrap_model=ForcedModel)
    app = create_app(state, security_for(cfg, adapter_dirs=(tempfile.gettempdir(),)))

    def script(body: dict) -> str:
        spaces = [t for t in body.get("tools") or () if t.get("type") == "namespace"
                  and str(t.get("name", "")).startswith("mcp__")]
        answered = any(isinstance(i, dict) and i.get("type") == "function_call_output"
                       for i in body.get("input") or () if isinstance(body.get("input"), list))
        if not spaces or answered:
            return "Done."
        ns, tool = spaces[0]["name"], spaces[0]["tools"][0]["name"]
        name = (ns if ns.endswith("_") else ns + "__") + tool
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"text": "hi"}}) + \
            "\n</tool_call>"

    async def logged(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        chunks = []
        while True:
            m = await receive()
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        raw, entry, out = b"".join(chunks), {"path": scope["path"]}, []
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if scope["path"].endswith("/responses") and isinstance(body, dict):
            state.model.arm(script(body))
            entry["tools"] = [[t.get("type"), t.get("name")] for t in body.get("tools") or ()]
            entry["history_calls"] = [
                {k: i.get(k) for k in ("type", "namespace", "name")}
                for i in body.get("input") or () if isinstance(i, dict)
                and i.get("type") in ("function_call", "custom_tool_call")] if isinstance(
                body.get("input"), list) else []
        fed = [False]

        async def rcv():
            if not fed[0]:
                fed[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        async def snd(m):
            if m["type"] == "http.response.start":
                entry["status"] = m["status"]
            elif m["type"] == "http.response.body":
                out.append(m.get("body", b""))
                if not m.get("more_body"):
                    entry["calls"] = _calls(b"".join(out))
                    log.append(entry)
            await send(m)
        await app(scope, rcv, snd)

    return BackgroundServer(logged).start()


def _calls(body: bytes) -> list:
    """The call items of an answer (a streamed one's `response.output_item.done` events)."""
    items = []
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("data: ") and '"response.output_item.done"' in line:
            items.append(json.loads(line[6:])["item"])
    return [{k: it.get(k) for k in ("type", "namespace", "name", "arguments")}
            for it in items if it.get("type") in ("function_call", "custom_tool_call")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients-dir", default=str(Path(tempfile.gettempdir()) / "mlxp-clients"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out or REPO / "reports" / "real_clients" / version() / "codex-mcp")
    out.mkdir(parents=True, exist_ok=True)
    binary = install(Path(a.clients_dir), ["codex"])["codex"]
    log: list = []
    server = serve(log)
    with tempfile.TemporaryDirectory(prefix="codex-mcp-") as tmp:
        tmp = Path(tmp)
        (tmp / "mcp.py").write_text(MCP_SERVER)
        home, work = tmp / "home", tmp / "work"
        home.mkdir()
        work.mkdir()
        (home / "config.toml").write_text(
            'model = "qwen3-fixture"\nmodel_provider = "engine"\napproval_policy = "never"\n'
            'sandbox_mode = "danger-full-access"\n\n[model_providers.engine]\n'
            f'name = "engine-serve"\nbase_url = "{server.url}/v1"\nwire_api = "responses"\n'
            'env_key = "ENGINE_KEY"\n\n[mcp_servers.demo]\n'
            f'command = "{sys.executable}"\nargs = ["{tmp / "mcp.py"}", "{out / "mcp.log"}"]\n')
        (out / "mcp.log").write_text("")
        t0 = time.monotonic()
        p = subprocess.run([binary, "exec", "--skip-git-repo-check",
                            "--dangerously-bypass-approvals-and-sandbox",
                            "call the echo tool with text hi"], cwd=work, capture_output=True,
                           text=True, timeout=a.timeout,
                           env={**os.environ, "CODEX_HOME": str(home), "ENGINE_KEY": "x"})
        wall = time.monotonic() - t0
    server.stop()
    (out / "codex.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    (out / "requests.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    mcp = [json.loads(ln) for ln in (out / "mcp.log").read_text().splitlines() if ln.strip()]
    answered = [c for e in log for c in e.get("calls", ())]
    checks = {
        "namespace_sent": any(t == "namespace" and str(n).startswith("mcp__")
                              for e in log for t, n in e.get("tools", ())),
        "call_split": any(c.get("namespace", "").startswith("mcp__") and c.get("name") == "echo"
                          for c in answered),
        "mcp_tool_ran": any(m["method"] == "tools/call" and (m["params"] or {}).get("name") ==
                            "echo" for m in mcp),
        "history_with_namespace": any(h.get("namespace", "") and h.get("name") == "echo"
                                      for e in log for h in e.get("history_calls", ())),
        "all_200": bool(log) and all(e.get("status") == 200 for e in log),
        "codex_exit_0": p.returncode == 0}
    result = {"codex": binary, "exit": p.returncode, "wall_s": round(wall, 1),
              "requests": len(log), "checks": checks, "ok": all(checks.values())}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(
        "# Codex CLI → MCP tool through engine-serve (namespace tools)\n\n"
        f"`python experiments/codex_mcp.py`, engine {version()}, Codex (pinned in "
        "experiments/real_clients.py); the model's output scripted (see the script).\n\n"
        "| check | result |\n|---|---|\n" +
        "".join(f"| {k} | {'yes' if v else '**no**'} |\n" for k, v in checks.items()) +
        f"\nRequests: {len(log)}; Codex exit {p.returncode}; {wall:.1f} s.\n")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
