"""Test helpers: a running server, a scripted (forced-output) model, adapters.

`ForcedModel` wraps a real fixture model: every forward still runs (so the KV
cache, prompt cache and admission see the real model), but while a script is
armed the logits are replaced by a one-hot on the next scripted token, then on
EOS. This lets the tests drive the *whole* stack - engine loop, detokenizer,
stop matcher, tool router, wire format - with a known output (a tool call, a
stop string), which a random-weight model would never produce by itself.
With no script armed it returns the model's logits untouched.
"""

from __future__ import annotations

import json
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}},
        "required": ["city"]}}}]


NO_EOS = {"998": -100, "1000": -100}   # the qwen3 fixture's EOS ids: run to max_tokens


def uniq(prefix: str = "hi") -> str:
    """A fresh prompt, so no prompt-cache hit changes the path under test."""
    return f"{prefix} {uuid.uuid4().hex[:8]}"


class ForcedModel:
    def __init__(self, model, tokenizer):
        object.__setattr__(self, "_inner", model)
        object.__setattr__(self, "_tok", tokenizer)
        object.__setattr__(self, "_script", None)
        object.__setattr__(self, "_k", 0)
        object.__setattr__(self, "calls", 0)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def arm(self, text: Optional[str] = None, ids: Optional[list] = None):
        """Force `text` (or token ids) followed by EOS on the next generation."""
        if text is not None:
            ids = self._tok.encode(text, add_special_tokens=False)
        eos = min(self._tok.eos_token_ids)
        object.__setattr__(self, "_script", list(ids) + [eos])
        object.__setattr__(self, "_k", 0)
        return ids

    def disarm(self):
        object.__setattr__(self, "_script", None)
        object.__setattr__(self, "_k", 0)

    def __call__(self, inputs, cache=None, **kw):
        logits = self._inner(inputs, cache=cache, **kw)
        object.__setattr__(self, "calls", self.calls + 1)
        script = self._script
        if script is None:
            return logits
        last = int(inputs[0, -1].item())
        k = self._k
        if inputs.shape[1] == 1 and k > 0 and last == script[min(k, len(script)) - 1]:
            t = script[min(k, len(script) - 1)]
            k += 1
        else:
            t = script[0]
            k = 1
        object.__setattr__(self, "_k", k)
        v = logits.shape[-1]
        hot = mx.where(mx.arange(v) == t, 30.0, -30.0).astype(logits.dtype)
        return mx.broadcast_to(hot, logits.shape)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@dataclass
class Served:
    url: str
    state: object
    model: object          # the real model (unwrapped)
    tokenizer: object
    model_dir: Path
    forced: Optional[ForcedModel] = None
    bg: object = None

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def on_worker(self, fn, *args, **kw):
        """Run `fn` on the server's model thread, between requests (in-process refs)."""
        return self.state.gateway.call_sync(fn, *args, **kw)

    def generate(self, prompt, **kw):
        """In-process `engine.generate` on the same (unwrapped) model, no prompt cache."""
        import engine
        return self.on_worker(engine.generate, self.model, self.tokenizer, prompt, **kw)


def start_server(model_dir, *, forced: bool = False, security=None, **config) -> Served:
    """`security` (a SecurityConfig) defaults to the server's, with adapters mountable
    from the temp directory (where the tests write them)."""
    import tempfile

    from server.app import create_app, security_for
    from server.cli import BackgroundServer
    from server.state import ServerConfig, build_state

    cfg = ServerConfig(model=str(model_dir), **config)
    state = build_state(cfg, wrap_model=ForcedModel if forced else None)
    inner = state.model._inner if forced else state.model
    security = security or security_for(cfg, adapter_dirs=(tempfile.gettempdir(),))
    bg = BackgroundServer(create_app(state, security)).start()
    return Served(bg.url, state, inner, state.tokenizer, Path(model_dir),
                  state.model if forced else None, bg)


def stop_server(s: Served):
    s.bg.stop()
    s.state.gateway.close()


def make_adapter(model_dir, out_dir, seed: int, rank: int = 4, scale: float = 2.0,
                 keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")) -> Path:
    """A random mlx-lm-format LoRA adapter (B != 0, so it changes the output)."""
    import engine
    from engine.adapters import lora
    model, _ = engine.load(model_dir)
    mx.random.seed(seed)
    lora.apply_lora(model, rank=rank, scale=scale, num_layers=-1, keys=list(keys))
    for _, m in lora.lora_layers(model):
        m.lora_b = 0.5 * mx.random.normal(m.lora_b.shape)
    cfg = lora.adapter_config(rank, scale, 0.0, -1, keys=list(keys))
    lora.save_adapter(model, out_dir, cfg)
    return Path(out_dir)


def sse_events(raw: str):
    """(event name or None, data) pairs of an SSE body."""
    out = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        d = "\n".join(data)
        out.append((name, d if d == "[DONE]" else json.loads(d)))
    return out


def stream_chat_text(url: str, prompt: str, max_tokens: int, *, headers=None,
                     logit_bias=None) -> str:
    """The text of one streamed /v1/chat/completions request (asserts a 200)."""
    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True}
    if logit_bias:
        body["logit_bias"] = logit_bias
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text.append(c["delta"].get("content") or "")
    return "".join(text)


def wait_ready_line(p, pattern, timeout: float = 90):
    """(match, line) of the first line of a started `engine-serve` process's stdout that
    `pattern` (a compiled regex: its ready line) matches; AssertionError if it exits first or
    none comes within `timeout` seconds."""
    import time
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        line = p.stdout.readline()
        if not line:
            if p.poll() is not None:
                raise AssertionError(f"exited {p.returncode}: {p.stderr.read()}")
            continue
        m = pattern.search(line)
        if m:
            return m, line
    raise AssertionError("no ready line")
