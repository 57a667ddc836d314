"""A reference decoder in its own process, for `bench_server.py`.

    python -m experiments._decode_worker ours|mlx_lm MODEL_DIR

Loads one engine, says `ready` on stdout, then answers each JSON line on stdin
(`{"prompt": str, "gen": int, "bias": {id: value}}`) with one JSON line:
`{"ttft", "decode_tps", "tokens"}`, timed exactly as the benchmark's client
times a stream (first and last text chunk). Running it in a process of its
own, started like the servers and holding only its engine's model, keeps the
in-process reference under the same conditions as the server it is compared
with (the benchmark process itself holds both models and the HTTP clients).
"""

from __future__ import annotations

import json
import sys
import time


def _timed(segments):
    """Time a stream of (has_text, generation_tokens) as the HTTP client does."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for has_text, n in segments:
        if has_text:
            now = time.perf_counter()
            first = first or now
            last = now
    return {"ttft": first - t0, "decode_tps": (n - 1) / (last - first), "tokens": n}


def time_ours(model, tok, prompt, gen, bias):
    import engine
    return _timed((bool(s.text), s.generation_tokens) for s in engine.stream_generate(
        model, tok, prompt, max_tokens=gen, temperature=0.0, logit_bias=bias))


def time_mlx_lm(model, tok, prompt, gen, bias):
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors
    procs = make_logits_processors(logit_bias={int(k): v for k, v in bias.items()})
    return _timed((bool(r.text), r.generation_tokens) for r in mlx_lm.stream_generate(
        model, tok, prompt, max_tokens=gen, logits_processors=procs))


def main(argv=None):
    which, model_dir = (argv or sys.argv[1:])[:2]
    if which == "ours":
        import engine
        model, tok = engine.load(model_dir)
        run = time_ours
    else:
        import mlx_lm
        model, tok = mlx_lm.load(model_dir)
        run = time_mlx_lm
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(run(model, tok, req["prompt"], req["gen"], req["bias"])), flush=True)


if __name__ == "__main__":
    main()
