import sys, time; sys.path.insert(0, '.')
import mlx.core as mx, numpy as np
from experiments._common import build_pair, preset_config
from engine.lora import apply_lora
from train.segmented import segmented_value_and_grad
T = int(sys.argv[1])
m = build_pair(preset_config("1b"), "bfloat16", "ours"); m.freeze(); apply_lora(m, 8, 20.0, 0.0, -1); mx.eval(m.parameters())
batch = mx.array(np.random.default_rng(0).integers(4, 1000, size=(1, T+1)).astype(np.int32)); lengths = mx.array([[0, T+1]])
for kw in [dict(), dict(mlp_chunk=4096), dict(mlp_chunk=2048), dict(mlp_chunk=4096, chunk_size=512)]:
    for rep in range(2):
        mx.synchronize(); mx.clear_cache(); base = mx.get_active_memory(); mx.reset_peak_memory(); t = time.perf_counter()
        (l, _), g, st = segmented_value_and_grad(m, batch, lengths, 1, head="chunked", return_stats=True, **{"chunk_size": 1024, **kw})
        mx.eval(l, g); mx.synchronize()
        print(kw, rep, f"rest {base/1e9:.2f} fwd {st['forward_peak']/1e9:.2f} head {st['head_peak']/1e9:.2f} total {mx.get_peak_memory()/1e9:.2f} GB {time.perf_counter()-t:.2f}s loss {l.item():.5f}", flush=True)
