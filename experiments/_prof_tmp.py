"""Phase peaks of one segmented step at 1B (device profiling helper, not a benchmark).

    python experiments/_prof_tmp.py 32768,8192
"""
import sys, time; sys.path.insert(0, '.')
import mlx.core as mx, numpy as np
from experiments._common import build_pair, preset_config
from engine.lora import apply_lora
import train.segmented as S

m = build_pair(preset_config("1b"), "bfloat16", "ours"); m.freeze(); apply_lora(m, 8, 20.0, 0.0, -1); mx.eval(m.parameters())
G = 1e9


def one(T, kw, reps=2):
    batch = mx.array(np.random.default_rng(0).integers(4, 1000, size=(1, T + 1)).astype(np.int32)); lengths = mx.array([[0, T + 1]])
    for rep in range(reps):
        mx.synchronize(); mx.clear_cache(); base = mx.get_active_memory(); mx.reset_peak_memory(); t = time.perf_counter()
        (l, _), g, st = S.segmented_value_and_grad(m, batch, lengths, 1, head="chunked", return_stats=True, **{"chunk_size": 1024, **kw})
        mx.eval(l, g); mx.synchronize()
        print(T, kw, rep, f"rest {base/G:.3f} fwd {st['forward_peak']/G:.3f} head {st['head_peak']/G:.3f} "
              f"total {mx.get_peak_memory()/G:.3f} GB {time.perf_counter()-t:.3f}s loss {l.item():.5f}", flush=True)
        del g


def per_layer(T, kw):
    """Peak of each block's backward over the active memory when it starts."""
    orig = S._tok_backward
    rec = []

    def wrap(model, P, i, *a, **k):
        mx.synchronize(); act = mx.get_active_memory(); mx.reset_peak_memory()
        out = orig(model, P, i, *a, **k)
        mx.synchronize(); rec.append((i, act / G, mx.get_peak_memory() / G))
        return out
    S._tok_backward = wrap
    try:
        one(T, kw, reps=1)
    finally:
        S._tok_backward = orig
    for i, act, pk in rec:
        print(f"  layer {i:2d} backward: active at start {act:.3f} GB, peak {pk:.3f} GB (+{pk - act:.3f})")


Ts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32768").split(",")]
for T in Ts:
    cfgs = [dict(token_chunk=4096), dict(token_chunk=2048)]
    for kw in cfgs:
        one(T, kw)
per_layer(max(Ts), dict(token_chunk=4096))
