"""Quantized-KV quality: teacher-forced KL(float KV || quantized KV) per token.

For each model and KV mode, the float-KV run greedily continues a fixed prompt;
the quantized-KV run is then fed exactly the same tokens (teacher forcing), and
at every position we measure KL(p_float || p_quant) and whether the top-1 token
agrees. Reported as mean / median / p99 / max and top-1 agreement.

    python -m parity.kv_quality                 # CPU fixtures -> reports/kv_quant/<version>/
    python -m parity.kv_quality --model DIR     # any model (e.g. a 1B-shaped one on the H200)

This measures our engine only (quantized KV itself is bit-exact with mlx-lm /
mlx-optiq, see tests/parity); it is the gate any L3 KV speedup must pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import engine
from engine.kv.quant import make_policy
from engine.loader import load_model
from engine.step.stepper import generate_step

from .fixtures.models import FAMILIES, VOCAB, ensure_fixture

REPO = Path(__file__).resolve().parents[1]


def prompts(n: int = 3, length: int = 48, vocab: int = VOCAB) -> list[list[int]]:
    rng = np.random.default_rng(1234)
    return [rng.integers(32, vocab - 32, size=length).tolist() for _ in range(n)]


def default_group(model) -> int:
    """The largest KV group size every cache layer's head dim allows."""
    from engine.kv.quant import VALID_GROUPS, cache_head_dims
    dims = cache_head_dims(model)
    return max(x for x in VALID_GROUPS if all(d % x == 0 for d in dims))


def _modes(model, group_size: int | None = None) -> dict:
    """kv8, kv4 at `group_size` (default: default_group), and a mixed config (8-bit on the
    first half of the cache layers, 4-bit on the rest)."""
    from engine.kv.quant import cache_head_dims
    n = len(cache_head_dims(model))
    g = group_size or default_group(model)
    half = n // 2
    mixed = [{"layer_idx": i, "bits": 8 if i < half else 4, "group_size": g}
             for i in range(n)]
    return {"kv8": dict(kv_bits=8, kv_group_size=g), "kv4": dict(kv_bits=4, kv_group_size=g),
            "mixed8/4": dict(kv_config=mixed)}


def _run(model, tokens: list[int], prompt_len: int, policy) -> mx.array:
    """log-probs [T - prompt_len + 1, V] for positions prompt_len-1 .. T-1, teacher-forced."""
    caches = model.make_cache()
    t = mx.array(tokens)[None]
    model(t[:, : prompt_len - 1], cache=caches)
    policy.apply(caches)
    out = []
    for i in range(prompt_len - 1, len(tokens)):
        lg = model(t[:, i:i + 1], cache=caches)[0, -1].astype(mx.float32)
        policy.apply(caches)
        out.append(lg - mx.logsumexp(lg))
    return mx.stack(out)


def measure(model, prompt_list, steps: int = 32, group_size: int | None = None) -> dict:
    none = make_policy(model)
    modes = _modes(model, group_size)
    results = {m: {"kl": [], "top1": []} for m in modes}
    for p in prompt_list:
        # the float run's own greedy continuation is the teacher-forced sequence
        cont = [t for t, _ in generate_step(mx.array(p), model, max_tokens=steps)]
        seq = p + cont
        ref = _run(model, seq, len(p), none)
        for name, kw in modes.items():
            q = _run(model, seq, len(p), make_policy(model, quantized_kv_start=0, **kw))
            pr = mx.exp(ref)
            kl = (pr * (ref - q)).sum(-1)
            results[name]["kl"].extend(np.array(kl).tolist())
            results[name]["top1"].extend((mx.argmax(ref, -1) == mx.argmax(q, -1)).tolist())
    out = {}
    for name, r in results.items():
        kl = np.maximum(np.array(r["kl"]), 0.0)  # tiny negatives are float rounding
        out[name] = {"kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
                     "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
                     "top1_agreement": float(np.mean(r["top1"])), "tokens": int(kl.size)}
    return out


def run_fixtures(families=None, steps: int = 32) -> dict:
    rows = {}
    for fam in families or FAMILIES:
        model = load_model(ensure_fixture(fam, "bfloat16"))[0]
        rows[fam] = measure(model, prompts(), steps)
    return rows


def write(rows: dict, out_dir: Path, note: str):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kv_quant.json").write_text(json.dumps({"note": note, "results": rows}, indent=2))
    lines = [f"# Quantized-KV quality — mlx-parity {engine.__version__}", "", note, "",
             "Teacher-forced KL(float KV ‖ quantized KV) per generated token and top-1 agreement.", "",
             "| model | mode | KL mean | KL median | KL p99 | KL max | top-1 agree | tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for fam, modes in rows.items():
        for m, r in modes.items():
            lines.append(f"| {fam} | {m} | {r['kl_mean']:.3g} | {r['kl_median']:.3g} | "
                         f"{r['kl_p99']:.3g} | {r['kl_max']:.3g} | {r['top1_agreement']:.3f} | {r['tokens']} |")
    (out_dir / "kv_quant.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description="teacher-forced KL of quantized KV")
    ap.add_argument("--model", help="a model directory (default: the CPU fixtures, bf16)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", help="output dir (default reports/kv_quant/<version>[/<tag>])")
    ap.add_argument("--tag", default="cpu-fixtures")
    ap.add_argument("--group-size", type=int, default=None,
                    help="KV group size (default: the largest of 32/64/128 every layer allows)")
    ap.add_argument("--prompt-length", type=int, default=256, help="with --model")
    ap.add_argument("--dequant-attention", action="store_true",
                    help="L3: dequantize K/V and use the fused SDPA (engine/kv/dequant_attention.py);"
                         " the only way to run quantized KV on MLX 0.32.4's CUDA backend")
    a = ap.parse_args(argv)
    if a.dequant_attention:
        from engine.kv.dequant_attention import set_enabled
        set_enabled(True)
    if a.model:
        model = load_model(a.model)[0]
        vocab = model.args.vocab_size
        rows = {Path(a.model).name: measure(model, prompts(vocab=vocab, length=a.prompt_length),
                                            a.steps, a.group_size)}
    else:
        rows = run_fixtures(steps=a.steps)
    out = Path(a.out) if a.out else REPO / "reports" / "kv_quant" / engine.__version__ / a.tag
    cmd = " ".join(["python -m parity.kv_quality", *(sys.argv[1:] if argv is None else argv)])
    note = (f"Device {mx.default_device()}; reproduce: `{cmd}`"
            + ("; attention over quantized KV by dequantize + fused SDPA (L3)"
               if a.dequant_attention else ""))
    write(rows, out, note)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
