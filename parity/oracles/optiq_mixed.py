"""Run mlx-optiq's mixed-precision KV (`optiq.serve.install_mixed_kv`) over mlx-lm's
generation and save what it computed; `python -m parity.oracles.optiq_mixed SPEC OUT`.

`install_mixed_kv` patches mlx-lm process-wide and permanently (its
`maybe_quantize_kv_cache`, the server's `stream_generate` and batch cache
classes), so it runs in a child process: nothing else in the test session sees
the patch. SPEC is a JSON file `{"model", "prompt", "steps", "kv_config", "start"}`;
OUT gets an `.npz` with the schedule's logits and `generate_step`'s tokens/logprobs.
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> int:
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import mlx.core as mx
    import numpy as np
    from pathlib import Path
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from optiq.serve import _LayerQuantConfig, install_mixed_kv

    spec = json.loads(Path(spec_path).read_text())
    cfgs = [_LayerQuantConfig(int(e["layer_idx"]), int(e["bits"]), int(e.get("group_size", 64)))
            for e in spec["kv_config"]]
    install_mixed_kv(cfgs, spec["start"])
    gen_mod = sys.modules["mlx_lm.generate"]
    quantize = gen_mod.maybe_quantize_kv_cache          # optiq's per-layer version now
    trigger = max(c.bits for c in cfgs)

    model = load_model(Path(spec["model"]))[0]
    prompt = mx.array(spec["prompt"])[None]
    out = {}
    # 1. The comparison schedule (prefill prompt[:-1], then one token at a time).
    caches = make_prompt_cache(model)
    q = lambda: quantize(caches, spec["start"], 64, trigger)
    logits = []
    if prompt.shape[1] > 1:
        logits.append(model(prompt[:, :-1], cache=caches)); q()
    tok = prompt[:, -1:]
    for _ in range(spec["steps"] + 1):
        lg = model(tok, cache=caches); q()
        logits.append(lg)
        tok = mx.argmax(lg[:, -1], axis=-1)[:, None]
    mx.eval(logits)
    for i, lg in enumerate(logits):
        out[f"logits_{i}"] = np.array(lg.astype(mx.float32))
    out["quantized_layers"] = np.array([i for i, c in enumerate(caches) if hasattr(c, "bits")])
    # 2. mlx-lm's own generate_step with the patch in place.
    toks, lps = [], []
    for t, lp in gen_mod.generate_step(mx.array(spec["prompt"]), model, max_tokens=spec["steps"],
                                       kv_bits=trigger, kv_group_size=64,
                                       quantized_kv_start=spec["start"]):
        toks.append(int(t))
        lps.append(np.array(lp.astype(mx.float32)))
    out["tokens"] = np.array(toks)
    out["logprobs"] = np.stack(lps)
    np.savez(out_path, **out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
