"""Served benchmark: aggregate tok/s and TTFT under C concurrent streaming clients,
engine-serve vs mlx_lm.server on the same model in the same run.

    python experiments/bench_batching.py --quick                 # CPU: llama fixture (bf16)
    python experiments/bench_batching.py --model DIR --levels 1,8,32 --tag h100-1b
    python experiments/bench_batching.py --model DIR --levels 1,8,32 --ours-args "--tier l3" \
        --tag h100-1b-l3

engine-serve runs with `--batch N` (N = the largest level unless --ours-batch) plus
--ours-args; mlx_lm.server with `--decode-concurrency N` plus --mlx-lm-args.

Both servers run as subprocesses on the same model in the same run. At each
concurrency level C, C client threads each send one streaming `POST
/v1/completions` request at the same time: a fresh random prompt of --prompt
tokens, greedy, EOS banned with `logit_bias`, so every request decodes exactly
--gen tokens. The servers alternate per level and trial, and the median over
trials is reported. For each level:

- aggregate tok/s: all tokens over the time from the first request sent to the
  last request done;
- TTFT p50/p95: time from sending a request to its first text chunk;
- per-request decode tok/s (median);
- lost / duplicated: requests without exactly --gen tokens, or with more than
  one final chunk.

Each level starts with an untimed round of C clients x 8 tokens on both servers
(kernel compilation for the new batch shapes stays out of the figures).

Writes bench_batching.{csv,md,png} (a row per server and level) and served.csv (a row per
level: model, clients, ours_tok_s, mlx_lm_tok_s, ratio, ours_ttft_ms, mlx_lm_ttft_ms,
ours_failed, mlx_lm_failed, ours_stream_tok_s, mlx_lm_stream_tok_s, stream_ratio, ttft_ratio)
to reports/bench_server/<version>/<tag>/ (or --out). A failed request is one that errored,
was dropped, or did not stream exactly --gen tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments._common import machine, md_table, report_dir, write_csv  # noqa: E402
from experiments.bench_server import Server, free_port  # noqa: E402

FIELDS = ["model", "server", "clients", "batch", "trials", "agg_tps", "ttft_p50_ms",
          "ttft_p95_ms", "req_tps_p50", "lost", "duplicated", "wall_s"]


SERVED = ["model", "clients", "ours_tok_s", "mlx_lm_tok_s", "ratio", "ours_ttft_ms",
          "mlx_lm_ttft_ms", "ours_failed", "mlx_lm_failed", "ours_stream_tok_s",
          "mlx_lm_stream_tok_s", "stream_ratio", "ttft_ratio"]


def served_rows(rows) -> list:
    """The per-server rows joined per (model, level): ours / mlx-lm ratios (> 1 = we are
    faster; ttft_ratio < 1 = our first token comes sooner) and failed counts."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["model"], r["clients"]), {})[r["server"]] = r
    out = []
    for (m, c), d in by.items():
        o, ref = d.get("engine-serve"), d.get("mlx_lm.server")
        if not (o and ref):
            continue

        def q(a, b):
            return round(a / b, 3) if b else float("nan")
        out.append(dict(model=m, clients=c, ours_tok_s=o["agg_tps"], mlx_lm_tok_s=ref["agg_tps"],
                        ratio=q(o["agg_tps"], ref["agg_tps"]), ours_ttft_ms=o["ttft_p50_ms"],
                        mlx_lm_ttft_ms=ref["ttft_p50_ms"], ours_failed=o["lost"] + o["duplicated"],
                        mlx_lm_failed=ref["lost"] + ref["duplicated"],
                        ours_stream_tok_s=o["req_tps_p50"], mlx_lm_stream_tok_s=ref["req_tps_p50"],
                        stream_ratio=q(o["req_tps_p50"], ref["req_tps_p50"]),
                        ttft_ratio=q(o["ttft_p50_ms"], ref["ttft_p50_ms"])))
    return out


def start(model_dir, hf_cache, batch, which, extra=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_cache), "TOKENIZERS_PARALLELISM": "false"}
    port = free_port()
    if which == "ours":
        argv = [sys.executable, "-m", "server.cli", "--model", str(model_dir), "--port",
                str(port), "--batch", str(batch), "--prompt-cache", "0", *extra]
        name = "engine-serve"
    else:
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port",
                str(port), "--decode-concurrency", str(batch), *extra]
        name = "mlx_lm.server"
    s = Server(name, argv, port, env)
    s.wait()
    return s


def one(client, prompt, gen, bias, out, i, t_go):
    body = {"model": "default_model", "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "stream": True, "logit_bias": bias, "stream_options": {"include_usage": True}}
    first = last = None
    tokens, finals = None, 0
    t0 = time.perf_counter()
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
                ch = d.get("choices") or []
                if ch and ch[0].get("finish_reason"):
                    finals += 1
                if ch and ch[0].get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    except Exception as e:  # counted as lost
        out[i] = {"error": repr(e)}
        return
    end = time.perf_counter()
    out[i] = {"t0": t0, "end": end, "ttft": (first or end) - t0, "tokens": tokens,
              "finals": finals, "tail": end - (last or end),   # (the last text to the stream's end)
              "tps": (tokens - 1) / (last - first) if tokens and last and last > first else 0.0}


def level(url, prompts, gen, bias):
    import httpx
    n = len(prompts)
    clients = [httpx.Client(base_url=url, timeout=900) for _ in range(n)]
    out = [None] * n
    ts = [threading.Thread(target=one, args=(clients[i], prompts[i], gen, bias, out, i, 0))
          for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for c in clients:
        c.close()
    ok = [o for o in out if o and "error" not in o and o["tokens"] == gen]
    lost = n - len(ok)
    dup = sum(1 for o in out if o and o.get("finals", 0) > 1)
    if not ok:
        return dict(agg=0.0, ttfts=[], tps=[], tails=[], lost=lost, dup=dup, wall=0.0)
    wall = max(o["end"] for o in ok) - min(o["t0"] for o in ok)
    return dict(agg=sum(o["tokens"] for o in ok) / wall, ttfts=[o["ttft"] for o in ok],
                tps=[o["tps"] for o in ok], tails=[o["tail"] for o in ok], lost=lost, dup=dup,
                wall=wall)


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[k]


def bench(model_dir, levels, prompt_len, gen, trials, hf_cache, ours_batch=None,
          ours_args=(), mlx_lm_args=()):
    import numpy as np
    import engine
    _, tok = engine.load(model_dir)
    rng = np.random.default_rng(0)
    eos = sorted(tok.eos_token_ids)
    bias = {str(t): -1000.0 for t in eos}
    batch = max(levels)
    servers = {"ours": start(model_dir, hf_cache, ours_batch or batch, "ours", ours_args),
               "mlx_lm": start(model_dir, hf_cache, batch, "mlx_lm", mlx_lm_args)}
    rows = []
    try:
        for w, s in servers.items():      # warm-up (kernels, JIT)
            level(s.url, [tok.decode(rng.integers(32, 1000, prompt_len).tolist())] * 2, 8, bias)
        for c in levels:
            res = {w: [] for w in servers}
            # untimed warm-up at this concurrency on both servers: the first time a batch
            # reaches a row count, a GPU backend compiles kernels for the new shapes (one
            # H200 trial at 4 clients had a 5 s p95 TTFT from that alone)
            warm = [tok.decode(rng.integers(32, 1000, prompt_len).tolist()) for _ in range(c)]
            for w in servers:
                level(servers[w].url, warm, 8, bias)
            for t in range(trials):
                prompts = [tok.decode(rng.integers(32, 1000, prompt_len).tolist())
                           for _ in range(c)]
                order = list(servers) if t % 2 == 0 else list(servers)[::-1]
                for w in order:
                    res[w].append(level(servers[w].url, prompts, gen, bias))
            for w, rs in res.items():
                med = lambda key: statistics.median(r[key] for r in rs)
                ttfts = [x for r in rs for x in r["ttfts"]]
                tps = [x for r in rs for x in r["tps"]]
                rows.append(dict(model=Path(model_dir).name, server=servers[w].name, clients=c,
                                 batch=batch, trials=trials, agg_tps=round(med("agg"), 1),
                                 ttft_p50_ms=round(1000 * _pct(ttfts, 0.5), 1),
                                 ttft_p95_ms=round(1000 * _pct(ttfts, 0.95), 1),
                                 req_tps_p50=round(statistics.median(tps), 1) if tps else 0.0,
                                 lost=sum(r["lost"] for r in rs),
                                 duplicated=sum(r["dup"] for r in rs),
                                 wall_s=round(med("wall"), 2)))
                print(rows[-1], flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return rows


def write(rows, out: Path, note: str):
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_batching.csv", rows, FIELDS)
    write_csv(out / "served.csv", served_rows(rows), SERVED)
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["clients"]), {})[r["server"]] = r
    table = []
    for (m, c), d in by.items():
        o, ref = d.get("engine-serve"), d.get("mlx_lm.server")
        ratio = (o["agg_tps"] / ref["agg_tps"]) if o and ref and ref["agg_tps"] else float("nan")
        table.append([m, c, o and o["agg_tps"], ref and ref["agg_tps"], f"{ratio:.2f}×",
                      o and f"{o['ttft_p50_ms']} / {o['ttft_p95_ms']}",
                      ref and f"{ref['ttft_p50_ms']} / {ref['ttft_p95_ms']}",
                      o and o["req_tps_p50"], ref and ref["req_tps_p50"],
                      f"{o and o['lost']}/{o and o['duplicated']}",
                      f"{ref and ref['lost']}/{ref and ref['duplicated']}"])
    md = ["# Continuous batching: engine-serve --batch N vs mlx_lm.server --decode-concurrency N",
          "", note, "",
          md_table(["model", "clients", "ours agg tok/s", "mlx-lm agg tok/s", "ratio",
                    "ours TTFT p50/p95 ms", "mlx-lm TTFT p50/p95 ms", "ours req tok/s",
                    "mlx-lm req tok/s", "ours lost/dup", "mlx-lm lost/dup"], table), ""]
    (out / "bench_batching.md").write_text("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for name in ("engine-serve", "mlx_lm.server"):
            rs = [r for r in rows if r["server"] == name]
            ax[0].plot([r["clients"] for r in rs], [r["agg_tps"] for r in rs], "o-", label=name)
            ax[1].plot([r["clients"] for r in rs], [r["ttft_p50_ms"] for r in rs], "o-",
                       label=name)
        ax[0].set(xlabel="concurrent clients", ylabel="aggregate tok/s", xscale="log")
        ax[1].set(xlabel="concurrent clients", ylabel="TTFT p50 (ms)", xscale="log")
        ax[0].legend()
        fig.tight_layout()
        fig.savefig(out / "bench_batching.png", dpi=100)
    except ImportError:
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: the llama bf16 fixture)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--levels", default="1,4,8,16,32")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (64; --quick 32)")
    ap.add_argument("--gen", type=int, default=None, help="decode tokens (128; --quick 32)")
    ap.add_argument("--trials", type=int, default=None, help="(3; --quick 1)")
    ap.add_argument("--ours-batch", type=int, default=None,
                    help="engine-serve --batch (default: the largest level)")
    ap.add_argument("--ours-args", default="", help='extra engine-serve flags, e.g. "--tier l3"')
    ap.add_argument("--mlx-lm-args", default="", help="extra mlx_lm.server flags")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    quick = a.quick or not a.model
    model = a.model
    if model is None:
        from parity.fixtures.models import ensure_fixture
        model = str(ensure_fixture("llama", "bfloat16"))
    levels = [int(x) for x in a.levels.split(",")]
    prompt_len = a.prompt or (32 if quick else 64)
    gen = a.gen or (32 if quick else 128)
    trials = a.trials or (1 if quick else 3)
    with tempfile.TemporaryDirectory(prefix="hf-empty-") as hf:
        rows = bench(model, levels, prompt_len, gen, trials, hf, a.ours_batch,
                     a.ours_args.split(), a.mlx_lm_args.split())
    tag = a.tag or ("cpu-fixtures" if quick else "custom")
    out = Path(a.out) if a.out else report_dir("bench_server", tag)
    cmd = "python experiments/bench_batching.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    write(rows, out, f"Machine: {machine()}, {os.cpu_count()} CPU cores. Streaming "
                     f"`/v1/completions`, greedy, prompt {prompt_len} tokens, {gen} decode tokens "
                     f"(EOS banned), engine-serve --batch {a.ours_batch or max(levels)} "
                     f"{a.ours_args}, mlx_lm.server --decode-concurrency {max(levels)} "
                     f"{a.mlx_lm_args}, median of {trials} "
                     f"trial(s). Reproduce: `{cmd.strip()}`")
    print(out / "bench_batching.md")


if __name__ == "__main__":
    main()
