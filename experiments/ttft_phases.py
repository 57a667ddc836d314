"""Where a cached agent turn's time to first token goes, phase by phase, in our server.

The server runs in this process (engine-serve's default flags: the batch, the RAM prompt cache)
with timers wrapped around the functions a streamed `/v1/chat/completions` request passes
through; the client replays `experiments/agent_session.py`'s session (same system prompt,
tools and turns) and times its first content chunk, as agent_session does. For each turn
every phase is the time from the previous mark to this one (ms), on one clock:

    body_read     client send -> the body read (the client's JSON, TCP, uvicorn's h11)
    body_check    the body guard (JSON values, depth, characters: json.loads of the body)
    validate      guard -> the route runs (FastAPI: json.loads again, pydantic validation)
    parse         the body -> a call.Call (messages, tools, sampling)
    to_encode     Call -> the prompt encode starts (params, tool-schema checks, thread hop)
    template      the chat template rendered (the whole conversation)
    tokenize      the rendered text tokenized (the whole conversation, or its new part)
    to_queue      encode done -> the job is queued (admission, grammar, parser; thread hop)
    to_worker     queued -> the worker starts it
    submit        Engine.submit (the ids checked, the request made)
    lookup        the prompt cache's lookup and the copy of the hit's KV (`PromptCache.fetch`)
    to_prefill    fetch done -> the suffix's prefill starts (the row joins the batch: its
                  caches stacked into the batch's)
    prefill       the suffix's prefill (every chunk, incl. any graduate/first-token forward)
    first_token   prefill done -> the first token handed to its job
    to_client     handed over -> the client has the first content chunk (event loop, SSE)

    python experiments/ttft_phases.py --prefix-tokens 800 --turns 4 --repeat 2 --csv FILE

Prints the medians of turns 2..N; `--out FILE` writes them as markdown, `--csv FILE` every
turn's phases. `--profile worker|loop` also prints a cProfile of the worker thread or of the
event loop over turns 2..N (top functions by cumulative time).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MARKS = ["sent", "body_read", "body_check", "validate", "parse", "to_encode", "template", "tokenize", "to_queue",
         "to_worker", "submit", "lookup", "to_prefill", "prefill", "first_token", "to_client"]

_log: dict = {}        # mark -> time of its end (first occurrence in the turn)
_acc: dict = {}        # mark -> summed time of every call in the turn
_armed = threading.Event()


def _note(name: str, t0: float, t1: float, first: bool = True) -> None:
    if not _armed.is_set():
        return
    _acc[name] = _acc.get(name, 0.0) + (t1 - t0)
    if first:
        _log.setdefault(name + ".start", t0)
    _log[name + ".end"] = t1


def _wrap(owner, attr: str, name: str, is_async: bool = False) -> None:
    fn = getattr(owner, attr)
    if is_async:
        @functools.wraps(fn)
        async def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                _note(name, t0, time.perf_counter())
    else:
        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _note(name, t0, time.perf_counter())
    setattr(owner, attr, w)


def instrument() -> None:
    import engine
    import engine.text.tokenizer as tk
    import server.call as call
    import server.openai as oa
    from engine.kv.prompt_cache import PromptCache
    from engine.step import batch, core
    from server import gateway

    from server import limits
    _wrap(limits.BodyGuard, "_read", "body_read", is_async=True)
    _wrap(limits.BodyGuard, "_checked_body", "body_check", is_async=True)
    _wrap(oa, "chat_completions", "endpoint", is_async=True)
    _wrap(oa, "parse_chat", "parse")
    _wrap(call, "encode", "encode")
    _wrap(tk, "render_chat_template", "template")
    _wrap(tk.Tokenizer, "encode", "tokenize")
    try:                       # (the chat path's encoder, where there is one)
        from engine.text.prefix_encode import PrefixEncoder
        _wrap(PrefixEncoder, "encode", "tokenize")
    except ImportError:
        pass
    _wrap(gateway.Gateway, "submit", "queue")
    _wrap(gateway.Gateway, "_start", "start")
    _wrap(core.Engine, "submit", "submit")
    _wrap(PromptCache, "fetch", "lookup")
    _wrap(core.Engine, "_start_row", "start_row")
    _wrap(batch.BatchScheduler, "_admit", "admit")
    _wrap(batch.BatchScheduler, "_prefill_chunk", "prefill_chunk")
    _wrap(batch.BatchScheduler, "_graduate", "graduate")
    _wrap(batch.BatchScheduler, "_decode_step", "decode_step")
    _wrap(core.Engine, "_solo_prefill", "solo_prefill")
    put = gateway.GenerationJob.put

    def put_w(self, out):
        if _armed.is_set() and out.text:
            _log.setdefault("put", time.perf_counter())
        return put(self, out)
    gateway.GenerationJob.put = put_w
    del engine


def breakdown(t_sent: float, t_first: float) -> dict:
    L = _log.get
    prefill_end = max(v for v in (L("solo_prefill.end"), L("prefill_chunk.end"),
                                  L("graduate.end")) if v is not None) \
        if any(L(k) for k in ("solo_prefill.end", "prefill_chunk.end", "graduate.end")) else None
    prefill_start = min(v for v in (L("solo_prefill.start"), L("prefill_chunk.start"),
                                    L("graduate.start")) if v is not None) \
        if prefill_end is not None else None
    pts = {"sent": t_sent, "body_read": L("body_read.end"),
           "body_check": L("body_check.end"), "validate": L("endpoint.start"),
           "parse": L("parse.end"),
           "to_encode": L("encode.start"), "template": L("template.end"),
           "tokenize": L("encode.end"), "to_queue": L("queue.start"),
           "to_worker": L("submit.start"), "submit": L("submit.end"),
           "lookup": L("lookup.end"), "to_prefill": prefill_start, "prefill": prefill_end,
           "first_token": L("put"), "to_client": t_first}
    out, prev = {}, None
    for m in MARKS:
        t = pts[m]
        if m != "sent":
            out[m] = None if t is None or prev is None else round((t - prev) * 1000, 1)
        prev = t if t is not None else prev
    out["ttft"] = round((t_first - t_sent) * 1000, 1)
    out["tokenize_ms"] = round(_acc.get("tokenize", 0) * 1000, 1)
    out["lookup_ms"] = round(_acc.get("lookup", 0) * 1000, 1)
    out["admit_ms"] = round(_acc.get("admit", 0) * 1000, 1)
    out["chunks_ms"] = round((_acc.get("prefill_chunk", 0) + _acc.get("solo_prefill", 0)) * 1000, 1)
    out["graduate_ms"] = round(_acc.get("graduate", 0) * 1000, 1)
    out["decode_ms"] = round(_acc.get("decode_step", 0) * 1000, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:long")
    ap.add_argument("--prefix-tokens", type=int, default=800)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-args", default="", help="extra engine-serve flags")
    ap.add_argument("--repeat", type=int, default=1, help="sessions (each a fresh cache)")
    ap.add_argument("--profile", choices=["worker", "loop"], default=None,
                    help="cProfile the worker thread or the event loop over turns 2..N")
    ap.add_argument("--out", default=None, help="write the medians' tables here (markdown)")
    ap.add_argument("--csv", default=None, help="write every turn's phases here")
    a = ap.parse_args(argv)

    from engine.loader import resolve_model_path
    from experiments.agent_session import client, session
    from server.app import create_app
    from server.cli import BackgroundServer, config_from_args, parser, security_from_args
    from server.state import build_state

    model_dir = str(resolve_model_path(a.model))
    system, tools, users = session(a.model, a.prefix_tokens, a.turns, a.turn_tokens)
    instrument()
    args = parser().parse_args(["--model", model_dir, *a.server_args.split()])
    config = config_from_args(args)
    state = build_state(config)
    app = create_app(state, security_from_args(args, config))
    prof = None
    if a.profile:
        import cProfile
        prof = cProfile.Profile()
    loop_prof = prof if a.profile == "loop" else None
    if loop_prof is not None:      # the event loop's thread: enabled while a request runs
        inner = app

        async def app(scope, receive, send):
            on = scope["type"] == "http" and _armed.is_set() and _log.get("turn", 0) > 1
            if on:
                loop_prof.enable()
            try:
                await inner(scope, receive, send)
            finally:
                if on:
                    loop_prof.disable()
    bg = BackgroundServer(app).start()
    rows = []
    try:
        for rep in range(a.repeat):
            if state.engine.prompt_cache is not None:
                state.gateway.call_sync(state.engine.prompt_cache.clear)
            messages, answers = [{"role": "system", "content": system}], []
            for i, user in enumerate(users):
                messages.append({"role": "user", "content": user})
                body = {"model": "m", "messages": messages, "tools": tools,
                        "max_tokens": a.max_tokens, "temperature": 0.0, "stream": True,
                        "stream_options": {"include_usage": True}}
                _log.clear()
                _acc.clear()
                _armed.set()
                _log["turn"] = i + 1
                if a.profile == "worker" and i > 0:
                    state.gateway.call_sync(prof.enable)
                t0 = time.perf_counter()
                first, text, usage = None, [], {}
                with client().stream("POST", bg.url + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        for ch in ev.get("choices") or ():
                            piece = (ch.get("delta") or {}).get("content")
                            if piece:
                                if first is None:
                                    first = time.perf_counter()
                                    _armed.clear()     # (the marks: up to the first chunk)
                                text.append(piece)
                        usage = ev.get("usage") or usage
                _armed.clear()
                if a.profile == "worker" and i > 0:
                    state.gateway.call_sync(prof.disable)
                row = {"rep": rep + 1, "turn": i + 1, "prompt": usage.get("prompt_tokens"),
                       "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                       **breakdown(t0, first or time.perf_counter())}
                rows.append(row)
                print(row, flush=True)
                answers.append("".join(text))
                messages.append({"role": "assistant", "content": answers[-1]})
                time.sleep(0.3)
    finally:
        bg.stop()
        state.gateway.close()
    later = [r for r in rows if r["turn"] > 1]
    cols = MARKS[1:] + ["ttft"]
    med = {c: round(statistics.median([r[c] for r in later if r[c] is not None] or [0]), 1)
           for c in cols}
    lines = ["| phase | median ms, turns 2..N |", "|---|---|"]
    lines += [f"| {c} | {med[c]} |" for c in cols]
    detail = ["tokenize_ms", "lookup_ms", "admit_ms", "chunks_ms", "graduate_ms", "decode_ms"]
    lines += ["", "| call (summed per turn) | median ms |", "|---|---|"]
    lines += [f"| {c} | {statistics.median([r[c] for r in later] or [0])} |" for c in detail]
    table = "\n".join(lines)
    print(table)
    if prof is not None:
        import io
        import pstats
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
        print(s.getvalue())
    if a.out:
        Path(a.out).write_text(table + "\n")
    if a.csv:
        from experiments._common import write_csv
        write_csv(Path(a.csv), rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
