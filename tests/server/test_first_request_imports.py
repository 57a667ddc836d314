"""A fresh server's first request pays nothing the warm-up could have paid: with the warm-up
(the default) the first streamed chat request with a tool imports no module (on an H100 a
restarted server's first turn took ~0.3 s more than the same turn on a running one; lazily
imported jsonschema alone was ~40 ms of it on the 2-core CPU). The control: without the
warm-up the same request imports jsonschema (the tool's schema check) and anyio's stream
modules (the streamed answer)."""

import os
import time
from pathlib import Path

import httpx

from experiments.served import Served

ROOT = Path(__file__).resolve().parents[2]
TOOL = {"type": "function", "function": {"name": "get", "description": "d", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


def _imported_by_first_request(*args) -> list:
    old = os.environ.get("PYTHONPROFILEIMPORTTIME")
    os.environ["PYTHONPROFILEIMPORTTIME"] = "1"     # (the server's stderr: one line an import)
    try:
        with Served(ROOT, list(args)) as s:
            time.sleep(0.5)
            n0 = len(s.stderr_lines)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "tools": [TOOL], "max_tokens": 3, "stream": True}
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body,
                              timeout=120) as r:
                assert r.status_code == 200
                assert any(line == "data: [DONE]" for line in r.iter_lines())
            time.sleep(0.3)
            return [ln.rsplit("|", 1)[-1].strip() for ln in s.stderr_lines[n0:]
                    if ln.startswith("import time:")]
    finally:
        if old is None:
            os.environ.pop("PYTHONPROFILEIMPORTTIME", None)
        else:
            os.environ["PYTHONPROFILEIMPORTTIME"] = old


def test_the_first_request_imports_nothing_after_the_warm_up():
    assert _imported_by_first_request() == []
    cold = _imported_by_first_request("--warm-up", "false")
    assert "jsonschema" in cold and "anyio.streams.memory" in cold, cold
