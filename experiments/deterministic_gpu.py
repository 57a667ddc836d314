"""Deterministic mode on a GPU (MLX's CUDA backend): the batch-invariant kernels
(engine/fast/invariant.py) checked op by op and end to end, with negative controls.

    python experiments/deterministic_gpu.py --model /tmp/m/1b --out DIR [--quant-model /tmp/m/1b-q4]

1. attention: one query's output computed alone (decode), in a batch of 4 rows at another
   column offset (left padding, boolean mask), inside prefill chunks of 200 and 7 queries
   ("causal") and split over several calls -> `mx.array_equal` with each other; its distance
   to MLX's own attention (max |diff|, a sanity figure, not a contract); control: MLX's own
   attention for the same query alone and inside the 200-query chunk.
2. matmuls: a row through a blocked Linear (bf16) and QuantizedLinear (4-bit) alone and among
   5, 64 and 200 rows at other places -> equal; control: the stock modules.
3. the needle (parity.needle): a prompt alone, then among 1, 7, 31 other rows joining and
   leaving -> same tokens and logprob vectors; control: the default mode on the same inputs.
   Prefill chunk sizes 2048 / 16 / 7 -> the same logprobs; a prompt-cache hit -> a cold run's.
4. cost in process: prefill and decode tok/s at 1, 8, 32 rows (512-token prompts) with and
   without --deterministic.
Writes deterministic_gpu.json to --out; prints one JSON line last.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import engine  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from engine.fast import invariant  # noqa: E402
from engine.kv.masks import causal_mask  # noqa: E402
from engine.kv.prompt_cache import PromptCache  # noqa: E402
from parity.needle import GREEDY, drive, ids, needle, same  # noqa: E402


def eq(a, b) -> bool:
    return bool(mx.array_equal(a, b).item())


def attention_checks(dtype=mx.bfloat16, H=32, Hkv=8, D=64, L=600, p=437, seed=0):
    """The query at position p of one row, computed six ways."""
    mx.random.seed(seed)
    k = mx.random.normal((1, Hkv, L, D)).astype(dtype)
    v = mx.random.normal((1, Hkv, L, D)).astype(dtype)
    qs = mx.random.normal((1, H, L, D)).astype(dtype)
    scale = D ** -0.5
    q1 = qs[:, :, p:p + 1]
    alone = invariant.attention(q1, k[:, :, :p + 1], v[:, :, :p + 1], scale, None)
    # a batch of 4, the row third, left padded by 37 columns (the others random)
    pad, B = 37, 4
    kb = mx.random.normal((B, Hkv, pad + p + 1, D)).astype(dtype)
    vb = mx.random.normal((B, Hkv, pad + p + 1, D)).astype(dtype)
    kb[2:3, :, pad:] = k[:, :, :p + 1]
    vb[2:3, :, pad:] = v[:, :, :p + 1]
    qb = mx.random.normal((B, H, 1, D)).astype(dtype)
    qb[2:3] = q1
    lp = mx.array([0, 5, pad, 11])
    mask = causal_mask(1, pad + p, left_padding=lp)
    batch = invariant.attention(qb, kb, vb, scale, mask)[2:3]
    # inside prefill chunks ending past p (causal), and one split over calls
    lo = p - 150
    chunk = invariant.attention(qs[:, :, lo:lo + 200], k[:, :, :lo + 200], v[:, :, :lo + 200],
                                scale, "causal")[:, :, 150:151]
    small = invariant.attention(qs[:, :, p - 3:p + 4], k[:, :, :p + 4], v[:, :, :p + 4],
                                scale, "causal")[:, :, 3:4]
    old = invariant.PARTIAL_BYTES
    invariant.PARTIAL_BYTES = 1 << 16
    try:
        split = invariant.attention(qs[:, :, lo:lo + 200], k[:, :, :lo + 200], v[:, :, :lo + 200],
                                    scale, "causal")[:, :, 150:151]
    finally:
        invariant.PARTIAL_BYTES = old
    stock_alone = mx.fast.scaled_dot_product_attention(q1, k[:, :, :p + 1], v[:, :, :p + 1], scale=scale)
    stock_chunk = mx.fast.scaled_dot_product_attention(
        qs[:, :, lo:lo + 200], k[:, :, :lo + 200], v[:, :, :lo + 200], scale=scale, mask="causal")[:, :, 150:151]
    ref = invariant.reference(q1.astype(mx.float32), k[:, :, :p + 1].astype(mx.float32),
                              v[:, :, :p + 1].astype(mx.float32), scale, None)
    return {
        "batch_equal": eq(alone, batch), "chunk200_equal": eq(alone, chunk),
        "chunk7_equal": eq(alone, small), "split_calls_equal": eq(alone, split),
        "max_abs_vs_f32_reference": float(mx.abs(alone.astype(mx.float32) - ref).max().item()),
        "stock_max_abs_vs_f32_reference": float(mx.abs(stock_alone.astype(mx.float32) - ref).max().item()),
        "control_stock_alone_vs_chunk_equal": eq(stock_alone, stock_chunk),
    }


def matmul_checks(seed=0):
    mx.random.seed(seed)
    out = {}
    lin = nn.Linear(2048, 8192, bias=False)
    lin.set_dtype(mx.bfloat16)
    qlin = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    for name, module, stock in (("bf16", lin, nn.Linear), ("q4", qlin, nn.QuantizedLinear)):
        row = mx.random.normal((1, 2048)).astype(mx.bfloat16)
        ins = {}
        for n, at in ((5, 3), (64, 40), (200, 130), (2048, 1500)):
            x = mx.random.normal((n, 2048)).astype(mx.bfloat16)
            x[at:at + 1] = row
            ins[n] = (x, at)
        module.__class__ = stock
        s_alone = module(row)
        s_many = {n: module(x)[at:at + 1] for n, (x, at) in ins.items()}
        invariant.apply(module)
        b_alone = module(row)
        b_many = {n: module(x)[at:at + 1] for n, (x, at) in ins.items()}
        out[name] = {"blocked_equal": {n: eq(b_alone, y) for n, y in b_many.items()},
                     "control_stock_equal": {n: eq(s_alone, y) for n, y in s_many.items()}}
        module.__class__ = stock
    return out


def engine_checks(model, tok, det: bool):
    def make(**kw):
        kw.setdefault("max_batch", 32)
        return Engine(model, tok, keep_logprob_arrays=True, deterministic=det, **kw)
    rng = random.Random(0)
    target = ids(rng, 20, 45)
    t0 = time.perf_counter()
    res = {"needle": needle(make, make(max_batch=1 if det else 2), target, rng)}
    prompt = ids(random.Random(3), 300, 300)
    runs = [drive(make(max_batch=4, prefill_step_size=n), [(0, prompt, GREEDY)])[0] for n in (2048, 16, 7)]
    res["chunking_equal"] = [same(r, runs[0]) for r in runs[1:]]
    rng = random.Random(1)
    a = ids(rng, 60, 60)
    eng = make(max_batch=4, prompt_cache=PromptCache(1 << 30), prefill_step_size=16)
    first = drive(eng, [(0, a, SamplingParams(max_tokens=12, temperature=0.0))])[0]
    b = a + first[0] + ids(rng, 5, 5)
    warm = drive(eng, [(0, b, GREEDY)])[0]
    cold = drive(make(max_batch=4), [(0, b, GREEDY)])[0]
    res["cached_equal"] = same(warm, cold)
    res["reused"] = eng.prompt_cache.stats()["tokens_reused"]
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def decode_cost(model, tok, det: bool, rows=(1, 8, 32), tokens=128, prompt=512, profile=None):
    """{rows: (prefill tok/s, decode tok/s)}: N requests of `prompt` random tokens submitted
    together; prefill = their prompt tokens / the time until every row has its first token,
    decode = the tokens after that / the time after it (a warm-up round first). `profile`: a
    cProfile.Profile run over the measured decode steps of the last row count."""
    out = {}
    for n in rows:
        eng = Engine(model, tok, max_batch=n, deterministic=det)
        rng = random.Random(n)
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        for warm in (True, False):
            mx.synchronize()
            t_sub = time.perf_counter()
            rids = {eng.submit(ids(rng, prompt, prompt), params) for _ in range(n)}
            started, t0, count = set(), None, 0
            while eng.has_unfinished():
                outs = eng.step()
                if t0 is not None:
                    count += sum(len(o.token_ids) for o in outs)
                    continue
                started.update(o.request_id for o in outs if o.token_ids)
                if started >= rids:
                    mx.synchronize()
                    t0 = time.perf_counter()
                    if profile is not None and not warm and n == rows[-1]:
                        profile.enable()
            mx.synchronize()
            if profile is not None:
                profile.disable()
            if not warm:
                out[n] = (round(n * prompt / (t0 - t_sub), 1),
                          round(count / (time.perf_counter() - t0), 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quant-model", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--cost-only", action="store_true", help="only part 4 (the bf16 model)")
    ap.add_argument("--profile", action="store_true",
                    help="print the host functions taking most time in decode steps (largest row count)")
    a = ap.parse_args(argv)
    res = {"device": str(mx.default_device()), "mlx": mx.__version__}
    if not a.cost_only:
        res.update(attention=attention_checks(), matmul=matmul_checks())
        print(json.dumps({"attention": res["attention"]}), flush=True)
        print(json.dumps({"matmul": res["matmul"]}), flush=True)
    for label, path in (("bf16", a.model), ("q4", None if a.cost_only else a.quant_model)):
        if not path:
            continue
        model, tok = engine.load(path)
        invariant.enable(False)
        if not a.cost_only:
            res[f"control_{label}"] = engine_checks(model, tok, False)
            print(json.dumps({f"control_{label}": res[f"control_{label}"]}), flush=True)
            res[f"det_{label}"] = engine_checks(model, tok, True)   # (applies the kernels)
            print(json.dumps({f"det_{label}": res[f"det_{label}"]}), flush=True)
        if not a.skip_cost and label == "bf16":
            prof = cProfile.Profile() if a.profile else None
            res["cost_det"] = decode_cost(model, tok, True, profile=prof)
            invariant.enable(False)
            # (the loaded model's matmuls stay blocked: the default mode runs a fresh load)
            model2, tok2 = engine.load(path)
            prof2 = cProfile.Profile() if a.profile else None
            res["cost_default"] = decode_cost(model2, tok2, False, profile=prof2)
            for name, pr in (("det", prof), ("default", prof2)):
                if pr is not None:
                    print(f"--- profile {name}")
                    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
            print(json.dumps({"cost_det": res["cost_det"], "cost_default": res["cost_default"]}), flush=True)
        invariant.enable(False)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deterministic_gpu.json").write_text(json.dumps(res, indent=1))
    ok = a.cost_only or (
        all(v for k, v in res["attention"].items() if k.endswith("_equal") and not k.startswith("control"))
        and all(all(m["blocked_equal"].values()) for m in res["matmul"].values()))
    print(json.dumps({"kernels_invariant": ok, **{k: res[k]["needle"] for k in res if k.startswith(("det_", "control_"))}}))


if __name__ == "__main__":
    main()
