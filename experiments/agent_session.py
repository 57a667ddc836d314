"""An agent session through HTTP: TTFT per turn, warm, after a server restart, and cold.

A coding agent (Claude Code, Codex, OpenCode) sends the same long prefix every turn: a
system prompt and tool definitions, then the conversation so far. This replays such a
session: a `--prefix-tokens` system prompt + tools (shaped like theirs: instructions,
then JSON-schema tools), then `--turns` turns, each adding a user message of about
`--turn-tokens` tokens and the model's previous answer (`--max-tokens`, greedy).

Phases, each a fresh server process on the same model:
- `warm`: engine-serve with `--prompt-cache-dir` (an empty directory): turn 1 is cold,
  the others reuse the prefix from RAM;
- `restart`: a server restarted before every turn, on its own directory (nothing in
  RAM): turn 1 is cold, every later turn reads the earlier turns' prefix back from disk
  and prefills only the new tokens;
- `replay`: engine-serve started again on the `warm` directory: the same session resumed,
  every turn's whole prompt but its last token already on disk;
- `default`: engine-serve with its default flags (the RAM prompt cache); `l3`: the same
  with `--tier l3` (the fast runner's kernels, prefill attention included);
- `cold`: engine-serve with no prompt cache (`--prompt-cache 0`): the prefill each turn
  would cost without reuse;
- `mlx_lm` (with `--mlx-lm`): `mlx_lm.server` on the same model, the same turns (its own
  RAM prompt cache).

Before the phases (`--warm-up`, on by default), an untimed session of the same sizes on another
prefix runs two turns on engine-serve and on mlx_lm.server: on CUDA, MLX compiles its kernels
at first use and caches them for every later process (`/tmp/mlx/<version>/ptx`), so without
it the first server of the run pays every compile in its timed turns (an 8B 4-bit first turn
took 35 s on an H100 that way, against 5.5 s for mlx_lm.server run after it).

TTFT = request sent -> first streamed content chunk (client side, streaming chat
completions, `max_tokens` answers; one HTTP client for the session, as an agent keeps). Also per turn: prompt tokens, cached tokens (our
usage), and the disk cache's bytes written by the turn (/stats).

    python experiments/agent_session.py --model builtin:long --prefix-tokens 4000   # CPU
    python experiments/agent_session.py --model DIR --prefix-tokens 24000 --mlx-lm --tag h100-8b

Writes agent_session.csv, .md and run.json to reports/prompt_cache_disk/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments._common import dump_json, machine, md_table, report_dir, write_csv  # noqa: E402
from experiments.served import Served  # noqa: E402

FIELDS = ["phase", "turn", "prompt_tokens", "cached_tokens", "ttft_ms", "disk_bytes_written",
          "disk_restore_ms", "prepare_ms", "queue_ms", "waiting_ms", "lookup_ms", "prefill_ms",
          "first_text_ms"]
WORDS = ("file read write edit search grep run test build diff patch commit branch module "
         "function class return value error path line column token cache prefix model "
         "request answer tool call argument schema string number object array").split()


def _text(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def _tools(rnd: random.Random, n: int) -> list:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": _text(rnd, 40),
        "parameters": {"type": "object", "properties": {
            f"arg_{j}": {"type": "string", "description": _text(rnd, 12)} for j in range(4)},
            "required": ["arg_0"]}}} for i in range(n)]


def session(model_dir: str, prefix_tokens: int, turns: int, turn_tokens: int, seed: int = 0):
    """(system text, tools, user messages): the system prompt sized so that system +
    tools come to about `prefix_tokens` tokens under the model's tokenizer."""
    from engine.loader import resolve_model_path
    from engine.text.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model_path(model_dir))
    rnd = random.Random(seed)
    tools = _tools(rnd, 12)
    per_word = len(tok.encode(_text(random.Random(1), 1000))) / 1000
    tool_tokens = len(tok.encode(json.dumps(tools)))
    system = _text(rnd, max(100, int((prefix_tokens - tool_tokens) / per_word)))
    users = [_text(rnd, max(10, int(turn_tokens / per_word))) for _ in range(turns)]
    return system, tools, users


_CLIENT: list = []


def client() -> httpx.Client:
    """One HTTP client for the whole session, made before the first turn's clock starts (an
    agent keeps its connection pool; a new `httpx.Client` builds an SSL context, ~20 ms of
    the client's own CPU on the 2-core box, that earlier runs counted in every turn's TTFT)."""
    if not _CLIENT:
        _CLIENT.append(httpx.Client(timeout=3600))
    return _CLIENT[0]


def ttft(url: str, model: str, messages: list, tools: list, max_tokens: int) -> dict:
    http = client()
    body = {"model": model, "messages": messages, "tools": tools, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code >= 400:
            r.read()
            print(f"HTTP {r.status_code}: {r.text[:2000]}", file=sys.stderr, flush=True)
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = ev.get("usage") or usage
    done = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_ms": round(((first or done) - t0) * 1000, 1), "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def _disk_stats(url: str) -> dict:
    try:
        return httpx.get(url + "/stats", timeout=30).json()["prompt_cache"].get("disk") or {}
    except (httpx.HTTPError, ValueError, KeyError):     # (mlx_lm.server has no /stats)
        return {}


PHASES = ("prepare_s", "queue_s", "waiting_s", "lookup_s", "prefill_s", "first_text_s")


def _server_phases(url: str) -> dict:
    """Where engine-serve says the turn's first token went (/stats queue.last_generation), ms:
    the request's preparation before the queue (body, template, tokens), its queue, the
    engine's waiting, lookup (a disk restore included) and prefill, and the first text's time
    from the job's start (the phases and what the engine does around them); the rest of the
    client's TTFT is the answer's way back. Empty for mlx_lm.server."""
    try:
        last = httpx.get(url + "/stats", timeout=30).json()["queue"]["last_generation"] or {}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}
    return {k[:-2] + "_ms": round(last[k] * 1e3, 1) for k in PHASES
            if isinstance(last.get(k), (int, float))}


def run_phase(name: str, url, model: str, system: str, tools: list, users: list,
              answers: list, max_tokens: int) -> list:
    """`url`: the server's address, or a callable giving the address of a server (re)started
    for each turn."""
    rows, messages = [], [{"role": "system", "content": system}]
    restart = url if callable(url) else None
    disk = {} if restart else _disk_stats(url)
    before, hits = int(disk.get("bytes_written", 0)), disk.get("hits", 0)
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if restart:
            url = restart()
        got = ttft(url, model, messages, tools, max_tokens)
        time.sleep(0.3)     # (the background write of the turn's new tokens)
        disk, phases = _disk_stats(url), _server_phases(url)
        after = int(disk.get("bytes_written", 0))
        if restart:
            print({"turn": i + 1, "disk": disk}, flush=True)
        rows.append({"phase": name, "turn": i + 1, "prompt_tokens": got["prompt_tokens"],
                     "cached_tokens": got["cached_tokens"], "ttft_ms": got["ttft_ms"],
                     "disk_bytes_written": after - before,
                     # (this turn's read of its prefix from disk, if it read one)
                     "disk_restore_ms": (disk.get("last_restore_ms", 0.0)
                                         if disk.get("hits", 0) > hits else 0.0), **phases})
        before = 0 if restart else after
        hits = 0 if restart else disk.get("hits", 0)
        if len(answers) <= i:      # the first phase's answers make every phase's history
            answers.append(got["text"])
        messages.append({"role": "assistant", "content": answers[i]})
        print(rows[-1], flush=True)
    return rows


class MlxLmServer:
    """`python -m mlx_lm.server` on a free port (the comparison; needs mlx-lm installed)."""

    def __init__(self, model: str):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", model,
                                      "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("mlx_lm.server did not start")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:long")
    ap.add_argument("--prefix-tokens", type=int, default=24000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--disk-gb", type=float, default=20.0)
    ap.add_argument("--mlx-lm", action=argparse.BooleanOptionalAction, default=False,
                    help="also run mlx_lm.server")
    ap.add_argument("--server-args", default="", help="extra engine-serve flags")
    ap.add_argument("--phases", default="warm,cold,replay,restart",
                    help="comma list of warm, cold, replay, restart, default (engine-serve with "
                         "its default flags: the RAM prompt cache only), l3 (default + --tier l3)")
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                    help="first an untimed session (another prefix, same sizes, 2 turns) on each "
                         "server kind, so no timed turn pays MLX's one-time kernel compiles")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=None,
                    help="report directory (default: reports/prompt_cache_disk/<version>/<tag>)")
    a = ap.parse_args(argv)
    phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    from engine.loader import resolve_model_path
    model_dir = str(resolve_model_path(a.model))
    system, tools, users = session(a.model, a.prefix_tokens, a.turns, a.turn_tokens)
    extra = a.server_args.split()
    rows, answers = [], []
    if a.warm_up:           # (MLX's CUDA kernels compile at first use, cached for every process)
        w_system, w_tools, w_users = session(a.model, a.prefix_tokens, 2, a.turn_tokens, seed=1)
        with Served(REPO, ["--model", model_dir, *extra]) as s:
            run_phase("warm-up", s.url, "m", w_system, w_tools, w_users, [], a.max_tokens)
        if a.mlx_lm:
            with MlxLmServer(model_dir) as m:
                run_phase("warm-up", m.url, model_dir, w_system, w_tools, w_users, [],
                          a.max_tokens)
    base = ["--model", model_dir, "--batch", "1", *extra]
    with tempfile.TemporaryDirectory(prefix="agent-session-") as tmp:
        disk = ["--prompt-cache-disk-gb", str(a.disk_gb), "--prompt-cache-dir"]
        warm, per_turn = disk + [str(Path(tmp) / "warm")], disk + [str(Path(tmp) / "restart")]
        plain = ["--model", model_dir, *extra]
        for phase, args in (("default", plain), ("l3", plain + ["--tier", "l3"]), ("warm", base + warm),
                            ("cold", base + ["--prompt-cache", "0"]), ("replay", base + warm)):
            if phase not in phases:
                continue
            with Served(REPO, args) as s:
                rows += run_phase(phase, s.url, "m", system, tools, users, answers, a.max_tokens)
        held: list = []

        def restarted() -> str:     # a fresh server process for each turn
            while held:
                gone = held.pop()
                took = gone.terminate(60)
                notes = [ln.strip() for ln in gone.stderr_lines if "prompt cache" in ln]
                on_disk = sorted((f.name[:12] + "…" + f.suffix, f.stat().st_size)
                                 for f in (Path(tmp) / "restart").glob("*.*"))
                # (what the disk cache said and left: why a turn missed)
                print({"server_exit_s": None if took is None else round(took, 2),
                       "prompt_cache_log": notes[-6:], "files": on_disk}, flush=True)
            held.append(Served(REPO, base + per_turn).start())
            try:            # (what the start paid for this turn: the warm-up's parts)
                warm = httpx.get(held[-1].url + "/stats", timeout=30).json().get("warm_up") or {}
            except (httpx.HTTPError, ValueError):
                warm = {}
            print({"warm_up": {k: warm.get(k) for k in (
                "seconds", "long_tokens", "rehearsed_bytes", "remembered_tokens",
                "turn_shapes")}}, flush=True)
            return held[-1].url
        try:
            if "restart" in phases:
                rows += run_phase("restart", restarted, "m", system, tools, users, answers,
                                  a.max_tokens)
        finally:
            while held:
                held.pop().terminate(20)
        files = sorted((Path(tmp) / "warm").glob("*.safetensors"))
        disk_files = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    if a.mlx_lm:
        with MlxLmServer(model_dir) as m:
            rows += run_phase("mlx_lm", m.url, model_dir, system, tools, users, answers,
                              a.max_tokens)
    by = {}
    for r in rows:
        by.setdefault(r["phase"], {})[r["turn"]] = r
    summary = {}
    for phase, turns in by.items():
        later = [turns[t]["ttft_ms"] for t in turns if t > 1]
        summary[phase] = {"turn1_ms": turns[1]["ttft_ms"],
                          "turns2_n_median_ms": statistics.median(later) if later else None}
    ratio = {}
    if "cold" in by and "restart" in by:
        cold = by["cold"]
        ratio = {t: round(by["restart"][t]["ttft_ms"] / cold[t]["ttft_ms"], 3) for t in cold}
        later = [r for t, r in ratio.items() if t > 1] or list(ratio.values())
        summary["restart_vs_cold"] = {"per_turn": list(ratio.values()), "max_turns_2_n": max(later)}
    if "mlx_lm" in by:
        for p in by:
            if p != "mlx_lm":
                summary[f"{p}_vs_mlx_lm_max_turns_2_n"] = max(
                    (by[p][t]["ttft_ms"] / by["mlx_lm"][t]["ttft_ms"] for t in by["mlx_lm"] if t > 1),
                    default=None)
    out = Path(a.out) if a.out else report_dir("prompt_cache_disk", a.tag)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "agent_session.csv", rows, FIELDS)
    dump_json(out / "run.json", {"args": vars(a), "machine": machine(), "summary": summary,
                                 "disk_files": disk_files})
    first = next(iter(by.values()))
    head = ["turn", *[f"{p} TTFT ms" for p in by], *[f"{p} cached" for p in by], "prompt tokens"]
    if ratio:
        head += ["restart/cold"]
    if "warm" in by:
        head += ["warm: bytes written"]
    table = []
    for t in sorted(first):
        row = [t, *[by[p][t]["ttft_ms"] for p in by], *[by[p][t]["cached_tokens"] for p in by],
               first[t]["prompt_tokens"]]
        row += [ratio[t]] if ratio else []
        row += [by["warm"][t]["disk_bytes_written"]] if "warm" in by else []
        table.append(row)
    (out / "agent_session.md").write_text(
        f"# Agent session: {a.turns} turns, ~{a.prefix_tokens}-token prefix ({a.model})\n\n"
        + md_table(head, table) + "\n\n```json\n" + json.dumps(summary, indent=2) + "\n```\n")
    print(json.dumps(summary, indent=2))
    print("wrote", out)
    return rows


if __name__ == "__main__":
    main()
