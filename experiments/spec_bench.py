"""Speculative decoding through HTTP on a model that has learned something.

Random weights accept almost no draft (their next-token distributions are flat), so this
script trains a target preset and a smaller draft of the same vocabulary (and tokenizer) on
the synthetic language of experiments/trained_gate.py (a Markov walk, then a copy of its
start), then serves the target with engine-serve three ways, all started in the same run:
plain, `--draft-model DRAFT`, and `--prompt-lookup N`. Each level sends that many concurrent
streaming greedy `/v1/completions` (token-id prompts: a walk and the first tokens of its copy,
so the continuation is the copy, a repeat of the prompt: the copy-heavy workload prompt
lookup is for; EOS banned), trials interleaved across the servers. Per level and mode:
aggregate and per-stream tok/s, TTFT (median and slowest), `ratio` = tok/s over the plain
server's in the same trials, the drafts kept / drafted and the draft's fast-runner traces made
during the timed trials (`draft_traces`: a new shape mid-serving) from the server's `/stats`.

    python experiments/spec_bench.py --target 1b --steps 500 --levels 1,8 --tag h100   # GPU
    python experiments/spec_bench.py --quick --out DIR                                 # CPU dry run

Writes `reports/spec_bench/<version>/<tag>/` (or `--out`): spec_bench.csv, spec_bench.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import command, machine, report_dir, write_table  # noqa: E402
from experiments.bench_batching import level, start  # noqa: E402
from experiments.presets import PRESETS, build_preset  # noqa: E402
from experiments.trained_gate import SMALL, Language, save_trained, train  # noqa: E402

# the draft: a few narrow layers over the target's vocabulary (ratio of sizes ~1:40 for the 1b)
DRAFT = dict(model_type="llama", hidden_size=512, num_hidden_layers=4, intermediate_size=1536,
             num_attention_heads=8, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=131072, tie_word_embeddings=False)
MODES = ("plain", "draft", "fastdraft", "lookup")
LAST_LOSS: dict = {}     # model -> its last training loss (in the report: how well it learned)
FIELDS = ["mode", "clients", "agg_tps", "req_tps_p50", "ttft_p50_ms", "ratio", "stream_ratio",
          "accepted", "drafted", "lost", "ttft_max_ms", "draft_traces", "tail_p50_ms", "agg_trials"]


def language(seed: int = 0) -> Language:
    """The synthetic language over tokens 0..999 (seed 0: the same tables for every model):
    no special token (the presets' tokenizer has them from 1008 on), so no EOS is ever
    learned and requests need no logit bias (a logits processor: alone it turns speculation
    off; as batch rows, since 0.5.3, each verify position is processed as a single step)."""
    lang = Language(1000)
    if seed:
        lang.rng = np.random.default_rng(1000 + seed)
    return lang


def trained(name: str, out: Path, steps: int, lr: float, batch: int, length: int) -> Path:
    """Preset `name` trained on the synthetic language (kept from an earlier run in `out`)."""
    from engine.loader import load_model
    if (out / name / "model.safetensors").exists():
        print(json.dumps({"trained": name, "kept": str(out / name)}), flush=True)
        return out / name
    src = build_preset(name, out / f"{name}-init")
    model = load_model(src)[0]
    # (warm-up and clipping: without them the 1b diverged in two of three H100 runs, last
    # loss 4.2 and 3.0 against 1.0, and a target that has learned nothing accepts nothing)
    losses = train(model, language(), steps, batch, length, lr, warmup=min(50, steps // 5),
                   clip=1.0)
    LAST_LOSS[name] = round(losses[-1], 3)
    print(json.dumps({"trained": name, "first_loss": losses[0], "last_loss": losses[-1]}), flush=True)
    return save_trained(model, src, out / name)


def trained_pair(target: str, work: Path, steps: int, draft_steps: int, quick: bool,
                 draft_layers: int = 4) -> tuple:
    """(target dir, draft dir): preset `target` and the draft (`DRAFT` over its vocabulary with
    `draft_layers` layers, 3× its learning rate) trained on the language in `work` (kept from
    an earlier run there); `quick`: both small (`SMALL` shapes), for a CPU check."""
    lr, batch, length = 3e-4, 16, 256
    if quick:
        PRESETS["spec-target"] = SMALL
        PRESETS["spec-draft"] = dict(SMALL, hidden_size=128, num_hidden_layers=2,
                                     intermediate_size=256, num_attention_heads=2,
                                     num_key_value_heads=2)
        target, lr, batch, length = "spec-target", 2e-3, 8, 128
    else:
        PRESETS["spec-draft"] = dict(DRAFT, vocab_size=PRESETS[target]["vocab_size"],
                                     num_hidden_layers=draft_layers)
    name = "spec-draft" if quick or draft_layers == 4 else f"spec-draft-{draft_layers}l"
    PRESETS[name] = PRESETS["spec-draft"]
    return (trained(target, work, steps, lr, batch, length),
            trained(name, work, draft_steps, lr * (1 if quick else 3), batch, length)
            if draft_steps else None)


def inflated(target: Path, shape: Optional[str], work: Path) -> Path:
    """The trained target in preset `shape`'s dimensions (experiments/inflate.py: its function,
    zero-padded, so a step costs what that shape's does; kept in `work`), or `target` itself."""
    if not shape:
        return target
    from experiments.inflate import inflate
    out = work / f"{target.name}-in-{shape}"
    if not (out / "model.safetensors").exists():
        inflate(target, out, shape)
    print(json.dumps({"inflated": str(out), "shape": shape}), flush=True)
    return out


def loaded_pair(target: str, work: Path, steps: int, quick: bool, draft_layers: int = 4,
                shape: Optional[str] = None) -> tuple:
    """(model, tokenizer, draft model): `trained_pair`'s target (in `shape`'s dimensions with
    one: `inflated`) and draft, both trained `steps` steps, loaded (spec_rounds, spec_stalls)."""
    import engine
    tdir, ddir = trained_pair(target, work, steps, steps, quick, draft_layers)
    model, tok = engine.load(str(inflated(tdir, shape, work)))
    return model, tok, engine.load(str(ddir))[0]


def prompts(n: int, gen: int, seed: int) -> list:
    """n token-id prompts: a walk of gen + 16 tokens, then the first 8 of its copy."""
    lang = language(seed + 1)
    out = []
    for _ in range(n):
        w = lang.walk(gen + 16)
        out.append(w + w[:8])
    return out


def spec_counts(url: str) -> tuple:
    """(accepted, drafted, the draft's fast-runner traces) so far, both speculation sources
    together (`/stats`; traces 0 without a fast draft runner)."""
    import httpx
    s = httpx.get(url + "/stats", timeout=30).json().get("speculation", {})
    return (sum(s.get(k, {}).get("accepted", 0) for k in ("draft", "lookup")),
            sum(s.get(k, {}).get("drafted", 0) for k in ("draft", "lookup")),
            (s.get("draft_fast") or {}).get("traces", 0))


def _grown(url: str, before: tuple) -> tuple:
    """`spec_counts` now, less `before`."""
    return tuple(a - b for a, b in zip(spec_counts(url), before))


def _median(xs: list) -> float:
    return statistics.median(xs) if xs else 0.0


def _measured(url: str, c: int, gen: int, trials: int, bias: dict):
    """An untimed warm-up at c clients (prompts as long as the trials', 8 tokens each: the
    prefill shapes a running server has seen), then `trials` timed levels (the interleaved
    run's prompts): their results and the speculation counters' growth over them."""
    level(url, prompts(c, gen, 99), 8, bias)
    before = spec_counts(url)
    res = [level(url, prompts(c, gen, t), gen, bias) for t in range(trials)]
    return res, _grown(url, before)


def _sequential(target, hf_cache, batch, argv: dict, levels, gen, trials, bias) -> dict:
    """{(mode, clients): (trial results, counters)}, one server up at a time."""
    out = {}
    for m, extra in argv.items():
        s = start(target, hf_cache, batch, "ours", extra)
        try:
            for c in levels:
                out[(m, c)] = _measured(s.url, c, gen, trials, bias)
        finally:
            s.stop()
    return out


def _interleaved(target, hf_cache, batch, argv: dict, levels, gen, trials, bias) -> dict:
    """{(mode, clients): (trial results, counters)}, every server up, trials interleaved
    (odd trials in the reverse order)."""
    servers = {m: start(target, hf_cache, batch, "ours", extra) for m, extra in argv.items()}
    modes, out = list(servers), {}
    try:
        for c in levels:
            for s in servers.values():      # untimed warm-up at this concurrency
                level(s.url, prompts(c, gen, 99), 8, bias)
            res = {m: [] for m in modes}
            counts0 = {m: spec_counts(s.url) for m, s in servers.items()}
            for t in range(trials):
                ps = prompts(c, gen, t)
                for m in (modes if t % 2 == 0 else modes[::-1]):
                    res[m].append(level(servers[m].url, ps, gen, bias))
            for m, s in servers.items():
                out[(m, c)] = (res[m], _grown(s.url, counts0[m]))
    finally:
        for s in servers.values():
            s.stop()
    return out


def bench(target: Path, draft: Path, levels, gen: int, trials: int, k: int, ngram: int, hf_cache,
          modes=MODES, lookup_k=None, draft_max_rows=None, ours_args=(), sequential=False):
    """`lookup_k`: the lookup server's draft tokens, one server per value (modes `lookup-kK`
    where there are several; default: k). `ours_args`: added to every server's arguments, the
    plain one's too (e.g. --tier l3: every server on the fast runner). `sequential`: one server
    at a time (models two of which do not fit the card together), else all up, trials
    interleaved."""
    bias: dict = {}                  # (none: see `language`)
    batch = max(levels)
    spec = ["--draft-model", str(draft), "--num-draft-tokens", str(k)]
    spec += (["--draft-max-rows", str(draft_max_rows)] if draft_max_rows else []) + ["--draft-tier"]
    extra = {"plain": [], "draft": spec + ["l1"], "fastdraft": spec + ["l3"]}   # (l3: fast runner)
    ks = list(lookup_k or [k])
    if "lookup" in modes:
        names = ["lookup"] if len(ks) == 1 else [f"lookup-k{x}" for x in ks]
        for name, x in zip(names, ks):
            extra[name] = ["--prompt-lookup", str(ngram), "--num-draft-tokens", str(x)]
        modes = tuple(m for m in modes if m != "lookup") + tuple(names)
    argv = {m: extra[m] + list(ours_args) for m in modes}
    runs = (_sequential if sequential else _interleaved)(target, hf_cache, batch, argv, levels,
                                                          gen, trials, bias)
    rows = []
    for c in levels:
        plain_agg = statistics.median(r["agg"] for r in runs[("plain", c)][0])
        plain_tps = statistics.median(x for r in runs[("plain", c)][0] for x in r["tps"] or [0.0])
        for m in modes:
            rs, (acc, dr, tr) = runs[(m, c)]
            agg = statistics.median(r["agg"] for r in rs)
            tps = statistics.median(x for r in rs for x in r["tps"] or [0.0])
            ttfts = sorted(x for r in rs for x in r["ttfts"])
            rows.append(dict(mode=m, clients=c, agg_tps=round(agg, 1), req_tps_p50=round(tps, 1),
                             ttft_p50_ms=round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else 0.0,
                             ratio=round(agg / plain_agg, 3) if plain_agg else 0.0,
                             stream_ratio=round(tps / plain_tps, 3) if plain_tps else 0.0,
                             accepted=acc, drafted=dr, lost=sum(r["lost"] for r in rs),
                             ttft_max_ms=round(1000 * ttfts[-1], 1) if ttfts else 0.0,
                             draft_traces=tr, tail_p50_ms=round(1000 * _median(
                                 [x for r in rs for x in r.get("tails", [])]), 1),
                             agg_trials=" ".join(str(round(r["agg"], 1)) for r in rs)))
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--quick", action="store_true", help="CPU dry run: small shapes, few steps")
    ap.add_argument("--steps", type=int, default=500, help="training steps of the target")
    ap.add_argument("--draft-steps", type=int, default=None, help="(default: --steps)")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="draft tokens a step (both sources)")
    ap.add_argument("--ngram", type=int, default=3, help="--prompt-lookup N")
    ap.add_argument("--lookup-k", default=None,
                    help="the lookup server's draft tokens, comma list: one server each (default --k)")
    ap.add_argument("--draft-layers", type=int, default=4, help="the draft model's layers")
    ap.add_argument("--inflate", default=None, choices=sorted(PRESETS),
                    help="serve the trained target padded into this preset's shape (e.g. 8b: "
                         "an 8B's step cost, the trained 1B's distributions; experiments/inflate.py)")
    ap.add_argument("--draft-max-rows", type=int, default=None,
                    help="the draft servers' --draft-max-rows (default: none)")
    ap.add_argument("--modes", default="draft,lookup", help="plain (always) and which of "
                    "draft, fastdraft (--draft-tier l3), lookup")
    ap.add_argument("--ours-args", default="", help="added to every server's arguments, the plain "
                    "one's too (e.g. '--tier l3': speculation on the fast runner against it plain)")
    ap.add_argument("--sequential", action="store_true", help="one server at a time (models two "
                    "of which do not fit the card together; default: all up, trials interleaved)")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None,
                    help="where the trained models go (kept: a second run there reuses them)")
    a = ap.parse_args(argv)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="spec_bench_"))
    if a.quick:
        a.target, a.steps = "spec-target", min(a.steps, 80)
        a.draft_steps = min(a.draft_steps or 40, 40)
        a.gen, a.trials, a.levels = min(a.gen, 32), min(a.trials, 1), "1,4"
    t0 = time.perf_counter()
    modes = ("plain",) + tuple(m for m in MODES[1:] if m in a.modes.split(","))
    draft_steps = ((a.draft_steps or a.steps) if {"draft", "fastdraft"} & set(modes)
                   else 0)                                                 # no draft: none trained
    target, draft = trained_pair(a.target, work, a.steps, draft_steps, a.quick, a.draft_layers)
    target = inflated(target, a.inflate, work)
    train_s = time.perf_counter() - t0
    # the buffers training and inflating left in MLX's cache go back to the card before the
    # servers load (on an H100 an 8B-shaped server ran out of memory at its start without it)
    import gc

    import mlx.core as mx
    gc.collect()
    mx.clear_cache()
    levels = [int(x) for x in a.levels.split(",") if x.strip()]
    lookup_k = [int(x) for x in a.lookup_k.split(",")] if a.lookup_k else None
    rows = bench(target, draft, levels, a.gen, a.trials, a.k, a.ngram, work / "hf", modes, lookup_k,
                 a.draft_max_rows, a.ours_args.split(), a.sequential)
    print(write_table(
        Path(a.out) if a.out else report_dir("spec_bench", a.tag), "spec_bench", FIELDS, rows,
        "Speculative decoding through HTTP (engine-serve: plain, --draft-model, --prompt-lookup)",
        f"Machine: {machine()}. Target `{a.target}`{' padded into the ' + a.inflate + ' shape' if a.inflate else ''} and draft `{draft.name if draft else '-'}` ({a.draft_layers} layers) trained on the synthetic "
        f"language ({a.steps} / {a.draft_steps or a.steps} steps, {train_s:.0f} s, last losses "
        f"{LAST_LOSS or 'kept from an earlier run'}); greedy, "
        f"{a.gen} tokens a request, K {a.k}, n-gram {a.ngram}, every server `{a.ours_args or 'default'}`"
        f"{', one server at a time' if a.sequential else ''}, "
        f"median of {a.trials}; ratio = tok/s "
        f"over the plain server's in the same trials. Reproduce: `{command('spec_bench.py', argv)}`"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
