"""One rank of the tensor-parallel parity check (run under `mlx.launch`).

    mlx.launch -n 2 --backend ring -- python3 tests/distributed/tp_worker.py OUT FAMILY:DTYPE...

For each fixture: mlx-lm's `sharded_load` model and ours (`engine.load(...,
tensor_parallel=True)`) run the same prompt; every step's logits (prefill, then
greedy decode with each side's KV cache) are compared with `mx.array_equal`, and
the greedy tokens of `engine.generate` are compared with mlx-lm's `generate_step`.
Writes OUT/rank<R>.json.

Both generators leave their last queued step running (`mx.async_eval`), mlx-lm's on
its own stream: collectives from two streams in flight at once interleave on the
ring and sum the wrong buffers, so every generation is followed by `settle()`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

import engine
from engine.loader import load_model
from engine.distributed.sharding import broadcast_json
from parity.fixtures.models import ensure_fixture
from parity.oracles.mlx_lm_oracle import greedy_generate, make_cache

PROMPT = "def add(a, b):\n    return"
STEPS = 6


def settle():
    """Wait for work still queued on mlx-lm's generation stream and on ours."""
    from mlx_lm.generate import generation_stream
    mx.synchronize(generation_stream)
    mx.synchronize()


def stepwise_logits(model, cache, ids, steps):
    """Prefill then greedy decode; the logits of the last position at every step."""
    out = []
    x = mx.array([ids])
    for _ in range(steps):
        logits = model(x, cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
        x = mx.argmax(logits, axis=-1, keepdims=True)
    return out


def check(family: str, dtype: str) -> dict:
    from mlx_lm.utils import sharded_load
    path = ensure_fixture(family, dtype, variant="tp2")
    ref, tok = sharded_load(str(path))
    ours, our_tok = engine.load(path, tensor_parallel=True)
    ids = tok.encode(PROMPT)
    a = stepwise_logits(ref, make_cache(ref), ids, STEPS)
    b = stepwise_logits(ours, engine.make_cache(ours), ids, STEPS)
    whole = load_model(path)[0]  # the unsharded model, for comparison
    c = stepwise_logits(whole, engine.make_cache(whole), ids, 1)
    ref_tokens = [t for t, _ in greedy_generate(ref, ids, STEPS)]
    settle()
    res = engine.generate(ours, our_tok, PROMPT, max_tokens=STEPS, temperature=0.0)
    settle()
    return {"family": family, "dtype": dtype,
            "logits_equal": [bool(mx.array_equal(x, y)) for x, y in zip(a, b)],
            "ref_tokens": ref_tokens, "our_tokens": list(res.token_ids), 
            "n_heads_per_rank": ours.layers[0].self_attn.n_heads,
            "n_kv_heads_per_rank": ours.layers[0].self_attn.n_kv_heads,
            "q_proj": type(ours.layers[0].self_attn.q_proj).__name__,
            "down_proj": type(ours.layers[0].mlp.down_proj).__name__,
            "unsharded_equal": bool(mx.array_equal(a[0], c[0]))}


def main(argv):
    out = Path(argv[0])
    group = mx.distributed.init()
    results = [check(*spec.split(":")) for spec in argv[1:]]
    sent = {"prompt": "héllo wörld", "max_tokens": 3} if group.rank() == 0 else {"x": 1}
    (out / f"rank{group.rank()}.json").write_text(json.dumps(
        {"rank": group.rank(), "size": group.size(), "results": results,
         "broadcast": broadcast_json(sent)}))


if __name__ == "__main__":
    main(sys.argv[1:])
