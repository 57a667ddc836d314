"""Where a lone served stream's time goes: engine-serve started once per variant, one
streaming `/v1/completions` request at a time (greedy, EOS banned), timed by the client and by
the server's own clock (`/stats` queue.last_generation: the engine's decode rate and the event
loop's CPU time), and, with py-spy on the PATH, the server sampled meanwhile (its functions by
own samples, each thread).

    python experiments/served_profile.py --model DIR --variants "--tier l3 --batch 1" \\
        "--tier l3 --batch 16" [--gen 256] [--trials 3] [--out DIR]

On an H100 (0.6.4) a lone 8B 4-bit stream decoded ~190 tok/s on `--tier l3 --batch 1` and
~130-150 on `--batch 16`, against 199 in process at 16 rows' engine: this says whether the
engine's loop or the HTTP side is the difference, and where.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments._common import REPO, dump_json  # noqa: E402
from experiments.served import Served  # noqa: E402


def stream(url: str, prompt: list, gen: int, bias: dict) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": gen, "temperature": 0.0,
            "stream": True, "logit_bias": bias, "stream_options": {"include_usage": True}}
    t0, first, end, n = time.perf_counter(), None, None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():     # (chunks may carry several tokens: usage counts them)
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if any(c.get("text") for c in ev.get("choices") or ()):
                    first, end = first or time.perf_counter(), time.perf_counter()
                n = (ev.get("usage") or {}).get("completion_tokens", n)
    last = httpx.get(url + "/stats", timeout=30).json()["queue"]["last_generation"]
    return {"client_tps": (n - 1) / (end - first) if first and n > 1 else None,
            "ttft_ms": 1e3 * (first - t0) if first else None,
            "engine_tps": last.get("decode_tps"), "loop_cpu_s": last.get("event_loop_cpu_s"),
            "decode_s": last.get("decode_s"), "tokens": last.get("generation_tokens")}


def top_frames(raw: Path, k: int) -> dict:
    """py-spy's raw (collapsed) samples: per thread, the k frames with most own samples."""
    own: dict = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames and count.isdigit():
            own[frames[0][:60]][frames[-1][:120]] += int(count)
    return {t: c.most_common(k) for t, c in own.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--variants", nargs="+", default=["--tier l3 --batch 1",
                                                      "--tier l3 --batch 16"])
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default="/tmp/served_profile")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt = [(7 * j + 11) % 1000 + 10 for j in range(a.prompt)]
    from engine.text.tokenizer import load_tokenizer
    bias = {str(t): -1000.0 for t in sorted(load_tokenizer(a.model).eos_token_ids)}
    spy = shutil.which("py-spy")
    results = []
    for k, v in enumerate(a.variants):
        with Served(REPO, ["--model", a.model, *v.split()]) as s:
            stream(s.url, prompt, 16, bias)                       # (warm: this shape's first run)
            trials = [stream(s.url, prompt, a.gen, bias) for _ in range(a.trials)]
            prof = None
            if spy:
                raw = out / f"pyspy-{k}.txt"
                rec = subprocess.Popen([spy, "record", "--pid", str(s.pid), "--format", "raw",
                                        "--rate", "500", "--nonblocking", "--threads",
                                        "-o", str(raw)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
                time.sleep(1.0)
                stream(s.url, prompt, a.gen, bias)
                rec.send_signal(2)
                rec.wait(60)
                prof = top_frames(raw, a.top) if raw.exists() else None
        row = {"variant": v, **{key: statistics.median(t[key] for t in trials)
                                for key in ("client_tps", "engine_tps", "ttft_ms", "loop_cpu_s",
                                            "decode_s") if all(t[key] is not None for t in trials)},
               "trials": trials, "profile": prof}
        print(json.dumps({k2: row[k2] for k2 in row if k2 not in ("trials", "profile")}),
              flush=True)
        results.append(row)
    dump_json(out / "served_profile.json", {"model": a.model, "gen": a.gen, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
