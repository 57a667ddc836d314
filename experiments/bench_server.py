"""Server benchmark: TTFT and decode tok/s over streaming HTTP, engine-serve vs mlx_lm.server.

Both servers are started here, on the same model, in the same run (as
subprocesses: `python -m server.cli` and `python -m mlx_lm server`, each with
its defaults), and driven with the same streaming `POST /v1/completions`
requests (raw text prompt, greedy, EOS banned with `logit_bias` so every run
decodes exactly `--gen` tokens). Each trial uses a fresh random prompt (the
same one for both servers), so neither server's prompt cache can help.
Engines alternate within a trial; the median over trials is reported.

- TTFT: request sent -> first non-empty text chunk received.
- decode tok/s: (tokens - 1) / (last text chunk - first text chunk), tokens
  from the response's usage.
- in-process: the same prompt through `engine.stream_generate` (and
  `mlx_lm.stream_generate`) in this process, timed the same way; server
  overhead = 1 - served decode tok/s / in-process decode tok/s.

    python experiments/bench_server.py --quick                  # CPU fixtures
    python experiments/bench_server.py --model DIR --tag h200-1b
    (a 1B-shaped random model: python -m experiments.presets 1b DIR)

Writes CSV + markdown + PNG to reports/bench_server/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, name, argv, port, env=None):
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout=600):
        import httpx
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def server_env(hf_cache):
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hf_cache), "TOKENIZERS_PARALLELISM": "false"}


def start_servers(model_dir, hf_cache, ours_args=()):
    env = server_env(hf_cache)
    p1, p2 = free_port(), free_port()
    ours = Server("engine-serve", [sys.executable, "-m", "server.cli", "--model", str(model_dir),
                                   "--port", str(p1), *ours_args], p1, env)
    ref = Server("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model",
                                   str(model_dir), "--port", str(p2)], p2, env)
    t_ours, t_ref = ours.wait(), ref.wait()
    print(f"servers up: ours {t_ours:.1f}s, mlx_lm {t_ref:.1f}s", flush=True)
    return ours, ref


_CLIENTS: dict = {}


def _client(url):
    # one keep-alive client per server, made before any timing (building an
    # httpx client costs tens of ms: its SSL context)
    import httpx
    if url not in _CLIENTS:
        _CLIENTS[url] = httpx.Client(base_url=url, timeout=600)
    return _CLIENTS[url]


def stream_http(url, prompt, gen, bias):
    client = _client(url)
    body = {"model": "default_model", "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "stream": True, "logit_bias": bias, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = None
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            ch = d.get("choices") or []
            if ch and ch[0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
    if first is None or tokens is None:
        # a stream without text or without its usage chunk: a finding, not a crash
        print(f"incomplete stream from {url}: text={'yes' if first else 'no'}, "
              f"usage={'yes' if tokens is not None else 'no'}", flush=True)
        return {"ttft": float("nan"), "decode_tps": float("nan"), "tokens": tokens, "failed": True}
    return {"ttft": first - t0, "decode_tps": (tokens - 1) / (last - first) if last > first
            else float("nan"), "tokens": tokens}


class DecodeWorker:
    """`experiments._decode_worker` in a subprocess: the in-process reference run
    in a process of its own (started like the servers, holding one model)."""

    def __init__(self, which, model_dir, env):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments._decode_worker", which, str(model_dir)],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"decode worker {which} did not start: {line!r}")

    def __call__(self, prompt, gen, bias):
        self.proc.stdin.write(json.dumps({"prompt": prompt, "gen": gen, "bias": bias}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _with_engine_clock(url, r):
    """Add the server's own clock of the same generation (`/stats` queue.last_generation:
    first to last text the engine handed over, before any HTTP work) to a served run."""
    last = (_client(url).get("/stats").json().get("queue") or {}).get("last_generation") or {}
    r["engine_tps"] = last.get("decode_tps") or float("nan")
    cpu, span = last.get("event_loop_cpu_s"), last.get("decode_s")
    r["loop_cpu_share"] = cpu / span if cpu is not None and span else float("nan")
    return r


def paired_ci(ratios, n_boot=2000, seed=0):
    """(median, lo, hi): the median of per-trial ratios and its bootstrap 95% interval."""
    import numpy as np
    r = np.asarray([x for x in ratios if x == x], dtype=float)
    if not len(r):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(r, size=(n_boot, len(r)), replace=True), axis=1)
    return float(np.median(r)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def make_prompt(tok, length, rng):
    ids = rng.integers(32, min(len(tok), 1000) - 1, size=length).tolist()
    return tok.decode(ids)


def bench(model_dir, lengths, gen, trials, hf_cache, ours_args=(), reference="worker",
          trial_rows=None):
    import numpy as np

    from engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    workers = []
    if reference == "worker":
        env = server_env(hf_cache)
        w_ours, w_ref = DecodeWorker("ours", model_dir, env), DecodeWorker("mlx_lm", model_dir, env)
        workers = [w_ours, w_ref]
        inproc_ours, inproc_ref = w_ours, w_ref
    else:
        import mlx_lm

        from experiments._decode_worker import time_mlx_lm, time_ours
        model = engine.load(model_dir)[0]
        ref_model, ref_tok = mlx_lm.load(str(model_dir))
        inproc_ours = lambda p, g, b: time_ours(model, tok, p, g, b)                # noqa: E731
        inproc_ref = lambda p, g, b: time_mlx_lm(ref_model, ref_tok, p, g, b)       # noqa: E731
    bias = {str(i): -100.0 for i in sorted(tok.eos_token_ids)}
    trial_rows = [] if trial_rows is None else trial_rows
    ours_srv, ref_srv = start_servers(model_dir, hf_cache, ours_args)
    rng = np.random.default_rng(0)
    rows = []
    try:
        warm = make_prompt(tok, 16, rng)
        for _ in range(2):
            stream_http(ours_srv.url, warm, 8, bias)
            stream_http(ref_srv.url, warm, 8, bias)
        for _ in range(2):
            inproc_ours(warm, 8, bias)
            inproc_ref(warm, 8, bias)
        for L in lengths:
            res = {k: [] for k in ("ours", "mlx_lm", "ours_inproc", "mlxlm_inproc")}
            shares = sorted(a["loop_cpu_share"] for a in res["ours"]
                            if a.get("loop_cpu_share", float("nan")) == a.get("loop_cpu_share"))
            for t in range(trials):
                prompt = make_prompt(tok, L, rng)
                order = [("ours", lambda: _with_engine_clock(
                              ours_srv.url, stream_http(ours_srv.url, prompt, gen, bias))),
                         ("mlx_lm", lambda: stream_http(ref_srv.url, prompt, gen, bias)),
                         ("ours_inproc", lambda: inproc_ours(prompt, gen, bias)),
                         ("mlxlm_inproc", lambda: inproc_ref(prompt, gen, bias))]
                if t % 2:
                    order = order[1::-1] + order[:1:-1]
                for name, fn in order:
                    res[name].append(fn())
            def _median(xs):
                xs = list(xs)
                return statistics.median(xs) if xs else float("nan")
            med = {k: {m: _median(r[m] for r in v if not r.get("failed"))
                       for m in ("ttft", "decode_tps")} for k, v in res.items()}
            ci = {k: paired_ci([a["decode_tps"] / b["decode_tps"]
                                for a, b in zip(res[k], res[k2]) if not a.get("failed")])
                  for k, k2 in (("ours", "ours_inproc"), ("mlx_lm", "mlxlm_inproc"))}
            # the same request on two clocks: the client's (served) and the server's
            # engine-side one; their ratio is what HTTP delivery costs, free of the
            # run-to-run noise that separates two runs
            ci["delivery"] = paired_ci([a["decode_tps"] / a["engine_tps"] for a in res["ours"]
                                        if not a.get("failed")])
            ci["engine"] = paired_ci([a["engine_tps"] / b["decode_tps"] for a, b in
                                      zip(res["ours"], res["ours_inproc"]) if not a.get("failed")])
            shares = sorted(a["loop_cpu_share"] for a in res["ours"]
                            if a.get("loop_cpu_share", float("nan")) == a.get("loop_cpu_share"))
            for t in range(trials):
                trial_rows.append({"model": Path(model_dir).name, "prompt": L, "trial": t,
                                   **{f"{k}_{m}": res[k][t].get(m) for k in res
                                      for m in ("ttft", "decode_tps")},
                                   "ours_engine_tps": res["ours"][t].get("engine_tps"),
                                   "ours_loop_cpu_share": res["ours"][t].get("loop_cpu_share")})
            row = {"model": Path(model_dir).name, "prompt_tokens": len(tok.encode(prompt)),
                   "gen": gen, "trials": trials,
                   "ours_ttft_ms": med["ours"]["ttft"] * 1e3,
                   "mlxlm_ttft_ms": med["mlx_lm"]["ttft"] * 1e3,
                   "ttft_ratio": med["ours"]["ttft"] / med["mlx_lm"]["ttft"],
                   "ours_decode_tps": med["ours"]["decode_tps"],
                   "mlxlm_decode_tps": med["mlx_lm"]["decode_tps"],
                   "decode_ratio": med["ours"]["decode_tps"] / med["mlx_lm"]["decode_tps"],
                   "ours_inproc_ttft_ms": med["ours_inproc"]["ttft"] * 1e3,
                   "mlxlm_inproc_ttft_ms": med["mlxlm_inproc"]["ttft"] * 1e3,
                   # what the HTTP server adds to TTFT (served - in-process, same engine)
                   "ours_server_ttft_ms": (med["ours"]["ttft"] - med["ours_inproc"]["ttft"]) * 1e3,
                   "mlxlm_server_ttft_ms": (med["mlx_lm"]["ttft"]
                                            - med["mlxlm_inproc"]["ttft"]) * 1e3,
                   "ours_inproc_decode_tps": med["ours_inproc"]["decode_tps"],
                   "mlxlm_inproc_decode_tps": med["mlxlm_inproc"]["decode_tps"],
                   "ours_overhead_pct": 100 * (1 - med["ours"]["decode_tps"]
                                               / med["ours_inproc"]["decode_tps"]),
                   "mlxlm_overhead_pct": 100 * (1 - med["mlx_lm"]["decode_tps"]
                                                / med["mlxlm_inproc"]["decode_tps"]),
                   # the same, from each trial's adjacent served / in-process pair (the
                   # four runs of a trial are back to back, so slow drift of the machine
                   # cancels within a pair): 1 - median of the per-trial ratios
                   "ours_overhead_paired_pct": 100 * (1 - ci["ours"][0]),
                   "mlxlm_overhead_paired_pct": 100 * (1 - ci["mlx_lm"][0]),
                   # bootstrap 95% interval of the paired overhead (lo, hi in %)
                   "ours_overhead_ci_lo": 100 * (1 - ci["ours"][2]),
                   "ours_overhead_ci_hi": 100 * (1 - ci["ours"][1]),
                   "mlxlm_overhead_ci_lo": 100 * (1 - ci["mlx_lm"][2]),
                   "mlxlm_overhead_ci_hi": 100 * (1 - ci["mlx_lm"][1]),
                   "reference": reference,
                   # ours split in two: HTTP delivery (same request, two clocks) and the
                   # engine inside the server vs the standalone reference (two runs)
                   "ours_delivery_pct": 100 * (1 - ci["delivery"][0]),
                   "ours_delivery_ci_lo": 100 * (1 - ci["delivery"][2]),
                   "ours_delivery_ci_hi": 100 * (1 - ci["delivery"][1]),
                   "ours_engine_slowdown_pct": 100 * (1 - ci["engine"][0]),
                   "ours_engine_slowdown_ci_lo": 100 * (1 - ci["engine"][2]),
                   "ours_engine_slowdown_ci_hi": 100 * (1 - ci["engine"][1]),
                   # CPU time of the server's event-loop thread over the decode span: all of
                   # its HTTP work; the most it can take from the engine thread via the GIL
                   "ours_loop_cpu_pct_p50": 100 * statistics.median(shares) if shares else float("nan"),
                   "ours_loop_cpu_pct_max": 100 * shares[-1] if shares else float("nan"),
                   "tokens_ok": all(r["tokens"] == gen for v in res.values() for r in v),
                   "incomplete_streams": {k: sum(bool(r.get("failed")) for r in v)
                                          for k, v in res.items() if k in ("ours", "mlx_lm")}}
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in row.items()}), flush=True)
            rows.append(row)
    finally:
        ours_srv.stop()
        ref_srv.stop()
        for w in workers:
            w.stop()
    return rows


def write(rows, out: Path, note: str, trial_rows=()):
    out.mkdir(parents=True, exist_ok=True)
    if trial_rows:
        with open(out / "bench_server_trials.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(trial_rows[0]))
            w.writeheader()
            w.writerows(trial_rows)
    with open(out / "bench_server.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [f"# Server benchmark — mlx-parity {engine.__version__}", "", note, "",
             "| model | prompt | TTFT ms ours / mlx_lm.server (ratio) | decode tok/s ours / "
             "mlx_lm.server (ratio) | in-process decode tok/s ours / mlx-lm | server overhead "
             "ours / mlx_lm.server | paired overhead [95% CI] ours / mlx_lm.server | TTFT added "
             "by the server ms ours / mlx_lm.server |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prompt_tokens']} | {r['ours_ttft_ms']:.1f} / "
            f"{r['mlxlm_ttft_ms']:.1f} ({r['ttft_ratio']:.3f}) | {r['ours_decode_tps']:.1f} / "
            f"{r['mlxlm_decode_tps']:.1f} ({r['decode_ratio']:.3f}) | "
            f"{r['ours_inproc_decode_tps']:.1f} / {r['mlxlm_inproc_decode_tps']:.1f} | "
            f"{r['ours_overhead_pct']:.1f}% / {r['mlxlm_overhead_pct']:.1f}% | "
            f"{r['ours_overhead_paired_pct']:.1f}% [{r['ours_overhead_ci_lo']:.1f}, "
            f"{r['ours_overhead_ci_hi']:.1f}] / {r['mlxlm_overhead_paired_pct']:.1f}% "
            f"[{r['mlxlm_overhead_ci_lo']:.1f}, {r['mlxlm_overhead_ci_hi']:.1f}] | "
            f"{r['ours_server_ttft_ms']:.1f} / {r['mlxlm_server_ttft_ms']:.1f} |")
    lines += ["", "TTFT ratio < 1: we answer first. Decode ratio > 1: we stream faster. "
              "Overhead = 1 - served / in-process decode tok/s of the same engine "
              "(target ≤ 2%); paired overhead = 1 - median over trials of served / in-process "
              "of the same trial (back-to-back runs), with the bootstrap 95% interval of that median; "
              "the target is met when the interval's upper end is ≤ 2%. In-process reference: "
              + ("each engine decoding in a process of its own (`experiments/_decode_worker.py`)"
                 if rows[0].get("reference") == "worker" else "this benchmark process") + ". "
              "TTFT added = served - in-process TTFT of the same engine.",
              "", "Ours split in two (median of per-trial ratios [bootstrap 95% CI]):",
              "", "| model | prompt | HTTP delivery: 1 − client / engine-side tok/s, same request "
              "| engine in the server vs standalone: 1 − engine-side / in-process tok/s "
              "| event-loop thread CPU / decode time, median (max) |",
              "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prompt_tokens']} | {r['ours_delivery_pct']:.2f}% "
            f"[{r['ours_delivery_ci_lo']:.2f}, {r['ours_delivery_ci_hi']:.2f}] | "
            f"{r['ours_engine_slowdown_pct']:.1f}% [{r['ours_engine_slowdown_ci_lo']:.1f}, "
            f"{r['ours_engine_slowdown_ci_hi']:.1f}] | {r['ours_loop_cpu_pct_p50']:.2f}% "
            f"({r['ours_loop_cpu_pct_max']:.2f}%) |")
    lines += ["", "Engine-side tok/s: `/stats` queue.last_generation, the server's clock from the "
              "first to the last text the engine handed over (before any HTTP work); it is "
              "timed like the client and the in-process reference time theirs. Event-loop CPU: "
              "`/stats` queue.last_generation.event_loop_cpu_s (the CPU clock of the thread "
              "that runs every HTTP handler and stream writer, over the same span) / decode_s: "
              "the share of the decode during which HTTP work could hold the GIL, an upper "
              "bound on what it can take from the engine's thread that way."]
    (out / "bench_server.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        models = sorted({r["model"] for r in rows})
        for model in models:
            rs = [r for r in rows if r["model"] == model]
            x = [r["prompt_tokens"] for r in rs]
            axes[0].plot(x, [r["ours_ttft_ms"] for r in rs], marker="o", label=f"ours {model}")
            axes[0].plot(x, [r["mlxlm_ttft_ms"] for r in rs], marker="x", ls="--",
                         label=f"mlx_lm {model}")
            axes[1].plot(x, [r["ours_decode_tps"] for r in rs], marker="o", label=f"ours {model}")
            axes[1].plot(x, [r["mlxlm_decode_tps"] for r in rs], marker="x", ls="--",
                         label=f"mlx_lm {model}")
            axes[2].plot(x, [r["ours_overhead_pct"] for r in rs], marker="o",
                         label=f"ours {model}")
            axes[2].plot(x, [r["mlxlm_overhead_pct"] for r in rs], marker="x", ls="--",
                         label=f"mlx_lm {model}")
        for ax, t in zip(axes, ("TTFT (ms)", "served decode tok/s", "server overhead (%)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_title(t)
            ax.legend(fontsize=6)
        axes[2].axhline(2.0, color="gray", lw=0.8)
        fig.tight_layout()
        fig.savefig(out / "bench_server.png", dpi=110)
    except ImportError:  # pragma: no cover
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model dir (repeatable)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU: the llama fixture and the 31.5M `speed` preset")
    ap.add_argument("--lengths", default=None, help="prompt lengths (default 128,1024,4096; "
                    "--quick 32,256)")
    ap.add_argument("--gen", type=int, default=None, help="decode tokens (128; --quick 64)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--ours-args", default="", help="extra engine-serve flags, e.g. "
                    "'--stream-interval-ms 20'")
    ap.add_argument("--reference", choices=("worker", "bench"), default="worker",
                    help="where the in-process reference decodes: a process of its own per "
                    "engine (default) or this benchmark process (holding both models)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    quick = a.quick or not a.model
    lengths = [int(x) for x in (a.lengths or ("32,256" if quick else "128,1024,4096")).split(",")]
    gen = a.gen or (64 if quick else 128)
    plan = [(m, lengths) for m in (a.model or [])]
    if quick and not a.model:
        from experiments.presets import build_preset
        from parity.fixtures.models import ensure_fixture
        # the tiny fixture (per-token cost ~ms: overhead-dominated, the worst case for a
        # server) and the 31.5M `speed` preset (compute-heavier; short prompts only on CPU)
        plan = [(str(ensure_fixture("llama", "bfloat16")), lengths),
                (str(build_preset("speed", REPO / ".cache" / "presets" / "speed-float32",
                                  "float32")), lengths[:1])]
    trial_rows: list = []
    with tempfile.TemporaryDirectory(prefix="hf-empty-") as hf_cache:
        rows = []
        for m, ls in plan:
            rows += bench(m, ls, gen, a.trials, hf_cache, a.ours_args.split(), a.reference,
                          trial_rows)
    import mlx.core as mx
    tag = a.tag or ("cpu-fixtures" if quick else "custom")
    out = Path(a.out) if a.out else REPO / "reports" / "bench_server" / engine.__version__ / tag
    cmd = "python experiments/bench_server.py " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
    import mlx_lm
    write(rows, out, f"Device {mx.default_device()}, mlx {mx.__version__}, mlx-lm "
                     f"{mlx_lm.__version__}, {os.cpu_count()} CPU cores. Streaming "
                     f"`/v1/completions`, greedy, {gen} decode tokens, median of {a.trials} "
                     f"trials (fresh prompt each), in-process reference: {a.reference}. Reproduce: `{cmd.strip()}`",
          trial_rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
