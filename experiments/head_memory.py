"""Loss-head backward memory: one vjp over the checkpointed chunks vs chunk-by-chunk vjps.

    python experiments/head_memory.py T CHUNK      # CPU: e.g. 4096 128 (slow on a busy CPU)
"""
import sys, time; sys.path.insert(0, '.')
import mlx.core as mx, numpy as np
from engine.models import build
from engine.lora import apply_lora
from experiments.presets import PRESETS
import train.segmented as S
from train.loss import head_loss, selected_rows, split_batch
T, CH = int(sys.argv[1]), int(sys.argv[2])
cfg = dict(PRESETS["1b"], num_hidden_layers=1, intermediate_size=256, vocab_size=8000)
mx.random.seed(0); m = build(cfg); m.freeze(); apply_lora(m, 8, 20.0, 0.0, -1); mx.eval(m.parameters())
rng = np.random.default_rng(0)
batch = mx.array(rng.integers(4, 1000, size=(1, T + 1)).astype(np.int32)); lengths = mx.array([[0, T + 1]])
inputs, targets, mask = split_batch(batch, lengths); sel = selected_rows(mask)
h = (mx.random.normal((1, T, 2048)) * 0.5); mx.eval(h, targets, mask, sel)
P = S._Params(m); key = S.get_key()
def old():
    def head_fn(h_last):
        loss, _ = head_loss(m, h_last, targets, mask, "chunked", CH, sel); return [loss]
    (l,), (dh,) = mx.vjp(head_fn, [h], [mx.array(1.0)]); return l, dh
def new():
    l, dh, _ = S._chunked_head_vjp(m, P, h, targets, mask, CH, sel, key); return l, dh
res = {}
for name, fn in [("old", old), ("new", new)]:
    mx.synchronize(); mx.clear_cache(); base = mx.get_active_memory(); mx.reset_peak_memory(); t = time.perf_counter()
    l, dh = fn(); mx.eval(l, dh)
    res[name] = (l, dh)
    print(name, f"T={T} chunk={CH}: head peak over base {(mx.get_peak_memory()-base)/1e6:.1f} MB ([T,D] f32 = {T*2048*4/1e6:.1f} MB), {time.perf_counter()-t:.2f}s", flush=True)
print("loss equal", mx.array_equal(res["old"][0], res["new"][0]).item(), "dh equal", mx.array_equal(res["old"][1], res["new"][1]).item())
