"""What serving costs under tensor parallelism: `engine-serve --tensor-parallel` decode speed
next to `engine.generate` on the same sharded model in the same launch.

    python experiments/tp_serve.py                  # CPU here: 1 and 2 local ranks, ring
    python experiments/tp_serve.py --ranks 1,2 --gen 64 --trials 3 --tag cpu

For each rank count N the script runs itself under `mlx.launch -n N --backend ring`
(N = 1 runs plainly: a world of one rank). Every rank loads the model sharded, measures
`engine.generate` (greedy, `--gen` tokens, EOS suppressed; best decode tokens/s of
`--trials` after a warm-up), then serves `engine-serve --tensor-parallel --batch 4`. The
parent then sends the same request `--trials` times (best decode tokens/s, as the
server's /stats measures it: first to last token, before HTTP) and 4 requests at once
(completion tokens of all four over the wall time, prefill included). With N = 1 it
also measures a plain `engine-serve` (no --tensor-parallel) on the unsharded model.

`served_vs_generate` is what the server adds per token on top of the sharded forward:
the request broadcast before every step (two small all-reduces) plus the server's own
work. Results: reports/tp_serve/<version>/<tag>/ (tp_serve.csv, tp_serve.md, tp_serve.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import REPO, dump_json, machine, md_table, report_dir  # noqa: E402

PROMPT = "def fibonacci(n):\n    "


def _no_eos(tok) -> dict:
    return {int(t): -100.0 for t in tok.eos_token_ids}


def worker(out: Path, a) -> int:
    """One rank: engine.generate on the sharded model, then serve."""
    import mlx.core as mx

    import engine
    from server.cli import main as serve

    rank = mx.distributed.init().rank()
    m, tok = engine.load(a.model, tensor_parallel=True)
    best = 0.0
    for i in range(a.trials + 1):
        r = engine.generate(m, tok, PROMPT, max_tokens=a.gen, temperature=0.0,
                            logit_bias=_no_eos(tok))
        if i:                     # (the first run warms up)
            best = max(best, r.generation_tps)
    del m
    mx.synchronize()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "generate_tps": best}))
    return serve(["--model", a.model, "--port", str(a.port), "--batch", "4",
                  *(["--tensor-parallel"] if a.tp else [])])


def _post(url, body):
    import httpx
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def measure_server(url: str, a, no_eos: dict) -> dict:
    import httpx
    body = {"prompt": PROMPT, "max_tokens": a.gen, "temperature": 0, "logit_bias": no_eos}
    _post(url, body)                                   # warm-up
    best = 0.0
    for _ in range(a.trials):
        _post(url, body)
        g = httpx.get(url + "/stats").json()["queue"]["last_generation"]
        best = max(best, g["decode_tps"] or 0.0)
    done = []
    t0 = time.perf_counter()
    ts = [threading.Thread(target=lambda: done.append(_post(url, body))) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    toks = sum(d["usage"]["completion_tokens"] for d in done)
    return {"served_tps": best, "batch4_tps": toks / wall}


def run_one(n: int, tp: bool, a, no_eos: dict) -> dict:
    import httpx

    from parity.launch import free_port_block
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"tp_serve-{os.getpid()}-{n}-{int(tp)}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    port = free_port_block(1)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out),
           "--model", a.model, "--gen", str(a.gen), "--trials", str(a.trials),
           "--port", str(port)] + (["--tp"] if tp else [])
    if n > 1:
        cmd = [shutil.which("mlx.launch"), "-n", str(n), "--backend", a.backend,
               "--starting-port", str(free_port_block(n)), "--cwd", str(REPO), "--", *cmd]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > a.timeout:
                raise RuntimeError(f"{n} rank(s): the server did not start")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        res = measure_server(url, a, no_eos)
        res["generate_tps"] = json.loads((out / "rank0.json").read_text())["generate_tps"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(out, ignore_errors=True)
    return {"ranks": n, "server": "tensor_parallel" if tp else "plain", **res}


def report(rows: list, d: Path, a) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(rows)[["ranks", "server", "generate_tps", "served_tps", "batch4_tps"]]
    df["served_vs_generate"] = df.served_tps / df.generate_tps
    df.to_csv(d / "tp_serve.csv", index=False)
    cmd = " ".join(["python", "experiments/tp_serve.py"] + sys.argv[1:])
    table = md_table(list(df.columns), [[f"{v:.3f}" if isinstance(v, float) else v
                                         for v in row] for row in df.itertuples(index=False)])
    (d / "tp_serve.md").write_text(
        f"# Serving under tensor parallelism\n\nCommand: `{cmd}`\n\n"
        f"Backend `{a.backend}`; model `{Path(a.model).name}`; {a.gen} greedy tokens, EOS "
        f"suppressed; best of {a.trials} after a warm-up. `generate_tps`: `engine.generate` "
        "on the sharded model in the same launch (for `plain`, the unsharded model); "
        "`served_tps`: one request through the server, as /stats measures it; "
        "`batch4_tps`: 4 requests at once, completion tokens over wall time (prefill "
        "included). All ranks share this machine's cores and talk over loopback TCP, so "
        "more ranks are slower here; what the table shows is what the server adds on top "
        "of the sharded forward (`served_vs_generate`). Single runs of these "
        "millisecond-scale steps vary on a shared machine: repeat before reading a "
        f"ratio.\n\n{table}\n\nMachine: `{json.dumps(machine())}`\n")
    ax = df.assign(label=df.ranks.astype(str) + " " + df.server).set_index("label")[
        ["generate_tps", "served_tps", "batch4_tps"]].plot(kind="bar", figsize=(7, 4))
    ax.set_ylabel("tokens/s")
    ax.set_title("engine.generate vs engine-serve, by rank count")
    plt.tight_layout()
    plt.savefig(d / "tp_serve.png", dpi=100)
    print((d / "tp_serve.md").read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gen", type=int, default=64, help="tokens per request (64)")
    p.add_argument("--trials", type=int, default=3, help="measured repeats (3)")
    p.add_argument("--ranks", default="1,2", help="rank counts (1,2)")
    p.add_argument("--model", default=None, help="model directory (default: llama tp2 fixture)")
    p.add_argument("--backend", default="ring")
    p.add_argument("--timeout", type=float, default=300, help="server start limit, s")
    p.add_argument("--tag", default="cpu", help="report subdirectory")
    for hidden in ("--worker", "--port"):      # (the launched ranks)
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--tp", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(Path(a.worker), a)
    from parity.fixtures.models import ensure_fixture
    from engine.text.tokenizer import load_tokenizer
    a.model = a.model or str(ensure_fixture("llama", "float32", variant="tp2"))
    no_eos = {str(k): v for k, v in _no_eos(load_tokenizer(Path(a.model))).items()}
    t0 = time.perf_counter()
    rows = []
    for n in [int(x) for x in a.ranks.split(",")]:
        if n == 1:
            rows.append(run_one(1, False, a, no_eos))
        rows.append(run_one(n, True, a, no_eos))
        print(f"{n} rank(s): done", flush=True)
    d = report_dir("tp_serve", a.tag)
    report(rows, d, a)
    dump_json(d / "run.json", {"args": vars(a), "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    sys.exit(main())
