"""The L3 gate: the fast decode path against L1, teacher-forced, with a negative control.

For each model and prompt, L1 greedily continues the prompt; that sequence is then
fed to both paths (teacher forcing) and at every decode position we measure
KL(p_L1 || p_L3) and whether the top-1 tokens agree. The gate passes when the mean
KL is at most 1e-3 and top-1 agreement at least 0.99 (bf16 targets of the L3 tier).

A gate that cannot fail proves nothing, so every report also runs the L3 path
with a deliberately broken kernel (`engine.fast.kernels.inject_fault`: attention
that drops the newest key, RoPE one position off) and records that it fails.

For a model stored in a half-precision dtype the report also gives a rounding
floor (`floor:float32`, not a gate): the same weights run by the L1 path in float32,
against the L1 run in the stored dtype. Any two roundings of the same network
disagree by about that much; when the model's next-token distributions are
nearly flat (random weights) the floor's top-1 agreement is itself below 0.99.

With `--batch N` the gate also runs the fast runner's rows: N prompts of different
lengths, joining the batch at different steps and leaving when their sequence ends (rows
join and leave mid-flight, so the rows bucket changes), teacher-forced through the fast
runner (`engine.fast.slots.SlotPool` over `engine.fast.decode.FastStep`) against each row
alone on L1; variants `batchN:l3`, `batchN:fault:*`. With `--verify N` the same rows take the
fast runner's verify steps as speculating rows do (`SlotPool.verify`: up to K + 1 positions a
row a step, some taken back and fed again): variants `verifyNkK:l3`, `verifyNkK:fault:*`.

    python -m parity.l3_gate                         # CPU fixtures -> reports/l3_gate/<version>/cpu-fixtures/
    python -m parity.l3_gate --model DIR --tag h200-1b [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

import engine
from engine.fast import kernels
from engine.kv.batch_cache import batch_caches
from engine.fast.decode import FastDecoder, FastStep
from engine.fast.slots import SlotPool
from engine.levers import Levers, parse_spec, resolve
from engine.loader import load_model
from engine.step.stepper import generate_step

REPO = Path(__file__).resolve().parents[1]
MAX_MEAN_KL = 1e-3
MIN_TOP1 = 0.99
FAMILIES = ("llama", "qwen3")


@dataclass
class GateResult:
    model: str
    variant: str            # "l3" or "fault:<name>"
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float
    tokens: int
    bit_exact: bool         # every L3 logit vector equal to L1's
    passes: bool


def prompts(n: int = 3, length: int = 48, vocab: int = 1024, seed: int = 1234) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(32, vocab - 32, size=length).tolist() for _ in range(n)]


def teacher_forced(model, seq: list[int], prompt_len: int, decoder=None) -> mx.array:
    """float32 log-probs [len(seq) - prompt_len + 1, V] at positions prompt_len-1 .. end.
    Prefill (all but the last prompt token) is always the model's own forward (L1)."""
    caches = model.make_cache()
    t = mx.array(seq)
    model(t[None, : prompt_len - 1], cache=caches)
    out = []
    for i in range(prompt_len - 1, len(seq)):
        tok = t[i:i + 1]
        lg = decoder(tok, caches) if decoder is not None else model(tok[None], cache=caches)[:, -1]
        lg = lg[0].astype(mx.float32)
        out.append(lg - mx.logsumexp(lg))
        mx.eval(out[-1])
    return mx.stack(out)


def teacher_forced_pool(model, seqs: list[list[int]], prompt_lens: list[int], step: FastStep,
                        joins: list[int]) -> list:
    """The rows through the fast runner, joining and leaving: row b's prompt (all but its
    last token) is prefilled alone by the L1 forward and the row joins the pool at step
    joins[b]; then it is fed its own sequence, one token per step, and leaves once it is
    consumed. Returns, per row, float32 log-probs [len(seq) - prompt_len + 1, V]."""
    pool = SlotPool(step, model)
    order: list = []                       # the pool's rows (row indices, its order)
    fed = [0] * len(seqs)
    out = [[] for _ in seqs]
    t = 0
    while any(fed[b] < len(s) - pl + 1 for b, (s, pl) in enumerate(zip(seqs, prompt_lens))):
        for b, (seq, pl) in enumerate(zip(seqs, prompt_lens)):
            if joins[b] == t:
                c = model.make_cache()
                mx.eval(model(mx.array(seq[: pl - 1])[None], cache=c))
                pool.extend(batch_caches([c]))
                order.append(b)
        if order:
            toks = mx.array([seqs[b][prompt_lens[b] - 1 + fed[b]] for b in order])
            lg = pool(toks).astype(mx.float32)
            lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
            mx.eval(lp)
            for i, b in enumerate(order):
                out[b].append(lp[i])
                fed[b] += 1
            keep = [i for i, b in enumerate(order) if fed[b] < len(seqs[b]) - prompt_lens[b] + 1]
            if len(keep) < len(order):
                pool.filter(keep)
                order = [order[i] for i in keep]
        t += 1
    return [mx.stack(o) for o in out]


def teacher_forced_verify(model, seqs: list[list[int]], prompt_lens: list[int], step: FastStep,
                          k: int, seed: int = 0) -> list:
    """The rows through the fast runner's verify steps (`SlotPool.verify`), as speculating rows
    take them: each round every row feeds its next 1..k + 1 tokens (a seeded draw, so rows of
    different lengths share a step) and then takes back a seeded number of the ones after its
    first (`rewind`: rejected drafts), which it feeds again in a later round; a row leaves once
    its sequence is consumed. Returns, per row, float32 log-probs [len(seq) - prompt_len + 1, V]
    (each position's from the round that kept it)."""
    rng = np.random.default_rng(seed)
    pool = SlotPool.of_prompts(step, model, [s[: pl - 1] for s, pl in zip(seqs, prompt_lens)])
    order = list(range(len(seqs)))
    fed = [0] * len(seqs)
    out = [[] for _ in seqs]
    while order:
        left = [len(seqs[b]) - prompt_lens[b] + 1 - fed[b] for b in order]
        lengths = [int(rng.integers(1, min(k + 1, n) + 1)) for n in left]
        toks = [[seqs[b][prompt_lens[b] - 1 + fed[b] + j] if j < n else 0 for j in range(k + 1)]
                for b, n in zip(order, lengths)]
        lg = pool.verify(mx.array(toks, dtype=mx.int32), lengths).astype(mx.float32)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        mx.eval(lp)
        drop = []
        for i, (b, n) in enumerate(zip(order, lengths)):
            kept = int(rng.integers(1, n + 1))
            out[b] += [lp[i, j] for j in range(kept)]
            fed[b] += kept
            drop.append(k + 1 - kept)
        pool.rewind(drop)
        keep = [i for i, b in enumerate(order) if fed[b] < len(seqs[b]) - prompt_lens[b] + 1]
        if len(keep) < len(order):
            pool.filter(keep)
            order = [order[i] for i in keep]
    return [mx.stack(o) for o in out]


def _rows_gate(model_dir, rows: int, levers, prompt_list, steps: int, faults, name, label: str,
               run) -> list[GateResult]:
    """`rows` prompts, the b-th cut to a different length and continuing for a different number
    of tokens, through `run(fast_model, seqs, lens, step)` (and with each fault) against each row
    alone on L1, teacher-forced; variants `label:l3`, `label:fault:*`."""
    levers = levers or parse_spec("l3")
    ref_model = load_model(model_dir)[0]
    fast_model = load_model(model_dir)[0]
    vocab = ref_model.args.vocab_size
    base = prompt_list or prompts(rows, vocab=min(vocab, 1024))
    plist = [p[: max(8, len(p) - 5 * (b % 8))] for b, p in enumerate((base * rows)[:rows])]
    gens = [steps - 4 * (b % 4) for b in range(rows)]
    seqs = [p + [t for t, _ in generate_step(mx.array(p), ref_model, max_tokens=g)]
            for p, g in zip(plist, gens)]
    lens = [len(p) for p in plist]
    ref = [teacher_forced(ref_model, s, pl) for s, pl in zip(seqs, lens)]
    name = name or Path(model_dir).name
    results = []
    for fault in (None, *faults):
        step = FastStep(fast_model, levers)       # (fresh: no trace carries a fault over)
        if fault is None:
            got = run(fast_model, seqs, lens, step)
        else:
            with kernels.inject_fault(fault):
                got = run(fast_model, seqs, lens, step)
        parts = [compare(r, g) for r, g in zip(ref, got)]
        results.append(summarize(name, f"{label}:" + ("l3" if fault is None else f"fault:{fault}"), parts))
    return results


def run_batch_gate(model_dir, rows: int, levers: Optional[Levers] = None, prompt_list=None,
                   steps: int = 32, faults=kernels.FAULTS, name: Optional[str] = None) -> list[GateResult]:
    """The fast runner's rows (and each fault) against each row alone on L1: `rows`
    prompts, the b-th cut to a different length, joining at staggered steps and each
    continuing for a different number of tokens, so rows join and leave mid-flight."""
    joins = [4 * (b % 3) for b in range(rows)]
    return _rows_gate(model_dir, rows, levers, prompt_list, steps, faults, name, f"batch{rows}",
                      lambda m, seqs, lens, step: teacher_forced_pool(m, seqs, lens, step, joins))


def run_verify_gate(model_dir, rows: int, k: int = 4, levers: Optional[Levers] = None,
                    prompt_list=None, steps: int = 32, faults=kernels.FAULTS,
                    name: Optional[str] = None) -> list[GateResult]:
    """The fast runner's verify steps (speculating rows: each round up to k + 1 positions a row,
    some taken back and fed again, rows leaving as they end) and each fault, against each row
    alone on L1; variants `verify{rows}k{k}:l3`, `...:fault:*`."""
    return _rows_gate(model_dir, rows, levers, prompt_list, steps, faults, name, f"verify{rows}k{k}",
                      lambda m, seqs, lens, step: teacher_forced_verify(m, seqs, lens, step, k))


def compare(ref: mx.array, got: mx.array) -> dict:
    kl = mx.maximum((mx.exp(ref) * (ref - got)).sum(-1), 0.0)   # tiny negatives: rounding
    return {"kl": np.array(kl).tolist(),
            "top1": (mx.argmax(ref, -1) == mx.argmax(got, -1)).tolist(),
            "equal": bool(mx.array_equal(ref, got).item())}


def summarize(model: str, variant: str, parts: list[dict]) -> GateResult:
    kl = np.array([k for p in parts for k in p["kl"]])
    top1 = float(np.mean([t for p in parts for t in p["top1"]]))
    mean = float(kl.mean())
    return GateResult(model=model, variant=variant, kl_mean=mean, kl_p99=float(np.percentile(kl, 99)),
                      kl_max=float(kl.max()), top1=top1, tokens=int(kl.size),
                      bit_exact=all(p["equal"] for p in parts),
                      passes=mean <= MAX_MEAN_KL and top1 >= MIN_TOP1)


def run_gate(model_dir, levers: Optional[Levers] = None, prompt_list=None, steps: int = 32,
             faults=kernels.FAULTS, name: Optional[str] = None,
             floor: bool = True) -> list[GateResult]:
    """L3 (and each fault) against L1 on one model. Two copies of the model are loaded:
    the L3 levers may transform theirs (merged projections)."""
    levers = levers or resolve("l3")
    ref_model = load_model(model_dir)[0]
    fast_model = load_model(model_dir)[0]
    dec = FastDecoder(FastStep(fast_model, levers))
    vocab = ref_model.args.vocab_size
    prompt_list = prompt_list or prompts(vocab=min(vocab, 1024))
    name = name or Path(model_dir).name
    variants = {"l3": None, **{f"fault:{f}": f for f in faults}}
    f32_model = None
    if floor and ref_model.layers[0].input_layernorm.weight.dtype != mx.float32:
        f32_model = load_model(model_dir)[0]
        f32_model.set_dtype(mx.float32)
        variants["floor:float32"] = "floor"
    parts: dict = {v: [] for v in variants}
    for p in prompt_list:
        cont = [t for t, _ in generate_step(mx.array(p), ref_model, max_tokens=steps)]
        seq = p + cont
        ref = teacher_forced(ref_model, seq, len(p))
        for v, fault in variants.items():
            if fault is None:
                got = teacher_forced(fast_model, seq, len(p), dec)
            elif fault == "floor":
                got = teacher_forced(f32_model, seq, len(p))
            else:
                with kernels.inject_fault(fault):
                    # a fresh decoder: a traced step must not carry the fault into others
                    got = teacher_forced(fast_model, seq, len(p),
                                           FastDecoder(FastStep(fast_model, levers)))
            parts[v].append(compare(ref, got))
    return [summarize(name, v, parts[v]) for v in variants]


def load_config_vocab(model_dir) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


def verdict(results: list[GateResult]) -> str:
    """`pass`: every L3 row passes and every fault fails; `fail`: an L3 row fails;
    `invalid`: a fault passed, so this model and these prompts cannot tell a broken kernel
    from a working one (the gate proves nothing here, whatever the L3 rows say)."""
    gated = [r for r in results if not r.variant.startswith("floor")]
    if any(r.passes for r in gated if "fault:" in r.variant):
        return "invalid"
    return "pass" if all(r.passes for r in gated if "fault:" not in r.variant) else "fail"


def write(results: list[GateResult], out: Path, note: str) -> None:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in results]
    v = verdict(results)
    (out / "l3_gate.json").write_text(json.dumps({"note": note, "max_mean_kl": MAX_MEAN_KL,
                                                  "min_top1": MIN_TOP1, "verdict": v, "results": rows},
                                                 indent=2))
    df = pd.DataFrame(rows)
    for c in ("kl_mean", "kl_p99", "kl_max"):
        df[c] = df[c].map(lambda x: f"{x:.3g}")
    df["top1"] = df["top1"].map(lambda x: f"{x:.4f}")
    head = [f"# L3 gate — mlx-parity {engine.__version__}", "", note, "",
            f"Gate: mean KL(L1 ‖ L3) ≤ {MAX_MEAN_KL:g} and top-1 agreement ≥ {MIN_TOP1}, teacher-forced. "
            "Rows `fault:*` are the negative control (a deliberately broken kernel): they must fail. "
            "`floor:float32` (not a gate) is the L1 path in float32 against L1 in the stored "
            "dtype: how far plain rounding moves the same network.", "",
            f"**Verdict: {v}**" + (" (a fault passed: the negative control did not catch a broken "
                                    "kernel on this model, so the gate proves nothing here)"
                                    if v == "invalid" else ""), ""]
    table = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    table += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    (out / "l3_gate.md").write_text("\n".join(head + table) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model dir (repeatable; default: CPU fixtures)")
    ap.add_argument("--dtype", default="bfloat16", help="fixture dtype (with the CPU fixtures)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3, help="random prompts (48 tokens each)")
    ap.add_argument("--tier", default="l3", help="tier or lever spec, e.g. l3 or "
                    "l3-perf_kernel-fused_sdpa (see engine.levers.parse_spec)")
    ap.add_argument("--no-faults", action="store_true", help="skip the negative control")
    ap.add_argument("--batch", type=int, default=0,
                    help="also gate the batch fast step with this many rows decoding together")
    ap.add_argument("--verify", type=int, default=0,
                    help="also gate the fast runner's verify steps with this many speculating rows")
    ap.add_argument("--k", type=int, default=4, help="with --verify: the most drafts a row a step")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    levers = parse_spec(a.tier)
    models = a.model or []
    if not models:
        from .fixtures.models import ensure_fixture
        models = [str(ensure_fixture(f, a.dtype)) for f in FAMILIES]
    results = []
    for m in models:
        vocab = min(load_config_vocab(m), 1024)
        results += run_gate(m, levers, prompt_list=prompts(a.prompts, vocab=vocab), steps=a.steps,
                            faults=() if a.no_faults else kernels.FAULTS)
        if a.batch:
            results += run_batch_gate(m, a.batch, levers,
                                      prompt_list=prompts(a.prompts, vocab=vocab), steps=a.steps,
                                      faults=() if a.no_faults else kernels.FAULTS)
        if a.verify:
            results += run_verify_gate(m, a.verify, a.k, levers,
                                       prompt_list=prompts(a.prompts, vocab=vocab), steps=a.steps,
                                       faults=() if a.no_faults else kernels.FAULTS)
    for r in results:
        print(json.dumps(asdict(r)), flush=True)
    tag = a.tag or ("cpu-fixtures" if not a.model else "custom")
    out = Path(a.out) if a.out else REPO / "reports" / "l3_gate" / engine.__version__ / tag
    cmd = "python -m parity.l3_gate " + " ".join(argv if argv is not None else sys.argv[1:])
    write(results, out, f"Device {mx.default_device()}, mlx {mx.__version__}, CUDA kernels "
                        f"{'on' if kernels.cuda_available() else 'off (stock-MLX reference ops)'}; "
                        f"levers {levers.as_dict()}. Reproduce: `{cmd.strip()}`")
    print(f"wrote {out}")
    # L3 passes, every fault fails; the floor is information, not a gate
    return 0 if verdict(results) == "pass" else 1


if __name__ == "__main__":
    raise SystemExit(main())
