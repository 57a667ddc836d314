"""What deterministic mode costs on this machine: decode and prefill throughput of the Engine
with and without `deterministic=True`, at 1, 8 and 32 concurrent requests.

    python experiments/deterministic_cost.py                 # ~10 min on 2 CPU cores
    python experiments/deterministic_cost.py --clients 1,8 --tokens 32 --tag quick

Models: the llama and gemma3_text float32 fixtures (tiny: dispatch-bound) and `gemma3-mid`, a
gemma3_text built here with random weights at a size where the arithmetic shows (hidden 256,
8 layers S S F S S F S S, window 128, head_dim 64, 4 query / 2 KV heads, vocab 1024; 8M
parameters). Only
sliding-window layers cost anything in this mode (the window is appended and cut each step
instead of written in place: engine.deterministic), so llama measures the mode's fixed
overhead (none expected: the same code runs) and gemma3 its real cost.

Each cell: N requests submitted together (random prompts of `--prompt` tokens, greedy,
`--tokens` new tokens each, max_batch = N), the Engine stepped to the end; prefill tok/s =
prompt tokens / time to the last request's first token, decode tok/s = tokens after the
first / the time after it. Median of `--repeats` runs (after one warm-up run), the two modes
alternating. Writes
deterministic_cost.{csv,md,json} to reports/deterministic/<version>/<tag>/ (default tag cpu).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402

from experiments._common import dump_json, machine, md_table, report_dir, write_csv  # noqa: E402

FIELDS = ["model", "clients", "mode", "prefill_tps", "decode_tps", "runs"]
MID = dict(hidden_size=256, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=128,
           layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2
           + ["sliding_attention"] * 2)


def load(name):
    import engine
    from parity.fixtures.models import ensure_fixture
    if name != "gemma3-mid":
        return engine.load(str(ensure_fixture(name, "float32")))
    import json

    from engine.models import build
    path = ensure_fixture("gemma3_text", "float32")
    _, tok = engine.load(str(path))
    cfg = {**json.loads((path / "config.json").read_text()), **MID}
    mx.random.seed(0)
    model = build(cfg)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, tok


def one_run(model, tok, n, prompt_len, tokens, deterministic, seed):
    from engine import Engine, SamplingParams
    rng = random.Random(seed)
    eng = Engine(model, tok, max_batch=n, deterministic=deterministic)
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    for _ in range(n):
        eng.submit([rng.randrange(4, 1000) for _ in range(prompt_len)], params)
    firsts, count = {}, 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            if o.token_ids and o.request_id not in firsts:
                firsts[o.request_id] = time.perf_counter()
            count += len(o.token_ids)
    t1 = time.perf_counter()
    t_first = max(firsts.values())
    # (EOS may end a row early: count what was made)
    return n * prompt_len / (t_first - t0), (count - n) / max(t1 - t_first, 1e-9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,gemma3_text,gemma3-mid")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    t_all = time.time()
    for name in a.models.split(","):
        model, tok = load(name)
        for n in [int(c) for c in a.clients.split(",")]:
            runs = {False: [], True: []}
            for det in (False, True):
                one_run(model, tok, n, a.prompt, 4, det, 99)          # warm-up
            for r in range(a.repeats):          # the modes alternate: the load drifts
                for det in (False, True):
                    runs[det].append(one_run(model, tok, n, a.prompt, a.tokens, det, r))
            for det in (False, True):
                row = dict(model=name, clients=n, mode="deterministic" if det else "default",
                           prefill_tps=round(statistics.median(r[0] for r in runs[det]), 1),
                           decode_tps=round(statistics.median(r[1] for r in runs[det]), 1),
                           runs=a.repeats)
                rows.append(row)
                print(row, flush=True)
    out = Path(a.out) if a.out else report_dir("deterministic", a.tag)
    out.mkdir(parents=True, exist_ok=True)
    table = []
    by = {(r["model"], r["clients"], r["mode"]): r for r in rows}
    for r in rows:
        if r["mode"] != "deterministic":
            continue
        base = by[(r["model"], r["clients"], "default")]
        table.append([r["model"], r["clients"], base["prefill_tps"], r["prefill_tps"],
                      f"{100 * (r['prefill_tps'] / base['prefill_tps'] - 1):+.1f}%",
                      base["decode_tps"], r["decode_tps"],
                      f"{100 * (r['decode_tps'] / base['decode_tps'] - 1):+.1f}%"])
    cmd = "python experiments/deterministic_cost.py " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:])
    head = (f"Machine: {machine()}. Command: `{cmd.strip()}` ({time.time() - t_all:.0f} s). "
            f"{a.prompt}-token prompts, {a.tokens} new tokens, greedy, median of {a.repeats}.")
    write_csv(out / "deterministic_cost.csv", rows, FIELDS)
    dump_json(out / "deterministic_cost.json", {"rows": rows, "machine": machine(),
                                                "header": head})
    (out / "deterministic_cost.md").write_text("\n".join([
        "# Deterministic mode: what it costs (Engine, CPU)", "", head, "",
        md_table(["model", "clients", "prefill tok/s default", "prefill tok/s deterministic",
                  "prefill Δ", "decode tok/s default", "decode tok/s deterministic",
                  "decode Δ"], table), ""]))
    print(out / "deterministic_cost.md")


if __name__ == "__main__":
    main()
