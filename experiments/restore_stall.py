"""What a prefix read back from the disk prompt cache costs the rows already running.

After a restart, an agent's request whose long prefix is on disk arrives while another request
is decoding. Before 0.6.2 the whole read ran inside one engine step, and the running row waited
for it; now, while other rows run, the files are read about `RESTORE_PART_BYTES` a step
(`engine.step.reuse`). This measures both in one process: a first engine writes a
`--prefix-tokens` prompt's KV to a cache directory (a real prefill), then for each mode a fresh
engine on that directory (a restart) decodes a short request, the agent's request (the prefix +
a few tokens) joins, and the running row's gaps between tokens are recorded. `whole` reads the
files in one part (0.6.2's reader without the parts), `parts` as served.

    python experiments/restore_stall.py                   # CPU: the kvheavy preset (32 KiB/token)
    python experiments/restore_stall.py --model DIR --prefix-tokens 24000 --tag h100-1b

Writes run.json to reports/restore_stall/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments._common import dump_json, machine, report_dir  # noqa: E402


def run(model_dir: str, cache_dir: str, prefix: list, part_bytes: int, other_tokens: int) -> dict:
    import engine.step.reuse as reuse
    from engine import Engine, SamplingParams
    reuse.RESTORE_PART_BYTES = part_bytes
    eng = Engine.load(model_dir, max_batch=4, prompt_cache_dir=cache_dir)
    eng.submit([5, 6, 7, 8], SamplingParams(max_tokens=other_tokens, temperature=0.0),
               request_id="other")
    stamps, agent_at, agent_first, t_submit = [], None, None, None
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == "other" and o.token_ids:
                stamps.append(now)
            if o.request_id == "agent" and o.token_ids and agent_first is None:
                agent_first = now
        if agent_at is None and len(stamps) >= 8:       # the other row is decoding: join
            eng.submit(prefix + [9, 10, 11], SamplingParams(max_tokens=2, temperature=0.0),
                       request_id="agent")
            agent_at, t_submit = len(stamps), now
    eng.disk_cache.flush()      # (the agent's own new file: written before the directory goes)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    before = gaps[:agent_at - 1]
    during = [g for a, g in zip(stamps[1:], gaps) if t_submit <= a <= agent_first]
    disk = eng.disk_cache.stats()
    return {"part_bytes": part_bytes, "other_gap_ms_before_p50": round(statistics.median(before) * 1e3, 1),
            "other_gap_ms_while_reading_max": round(max(during, default=0.0) * 1e3, 1),
            "other_tokens_while_reading": len(during),
            "agent_ttft_ms": round((agent_first - t_submit) * 1e3, 1),
            "restore_ms": disk["last_restore_ms"], "tokens_restored": disk["tokens_restored"],
            "bytes_read": disk["bytes_read"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the kvheavy preset)")
    ap.add_argument("--prefix-tokens", type=int, default=12000)
    ap.add_argument("--other-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternated")
    ap.add_argument("--part-bytes", type=int, default=None,
                    help="the parts' size (default: engine.step.reuse.RESTORE_PART_BYTES)")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from engine import Engine, SamplingParams
    from engine.step.reuse import RESTORE_PART_BYTES
    with tempfile.TemporaryDirectory(prefix="restore-stall-") as tmp:
        model = a.model
        if model is None:
            from experiments.presets import build_preset
            model = str(build_preset("kvheavy", Path(tmp) / "kvheavy"))
        rnd = random.Random(0)
        prefix = [rnd.randrange(20, 1000) for _ in range(a.prefix_tokens)]
        cache = str(Path(tmp) / "cache")
        first = Engine.load(model, prompt_cache_dir=cache)
        first.submit(prefix, SamplingParams(max_tokens=1, temperature=0.0))
        while first.has_unfinished():
            first.step()
        first.disk_cache.flush()
        del first
        rows = []
        for r in range(a.rounds):
            for mode, size in (("whole", 1 << 50), ("parts", a.part_bytes or RESTORE_PART_BYTES)):
                fresh = Path(tmp) / f"cache-{mode}-{r}"      # (each run writes its own files)
                shutil.copytree(cache, fresh)
                row = {"mode": mode, "round": r + 1,
                       **run(model, str(fresh), prefix, size, a.other_tokens)}
                shutil.rmtree(fresh)
                print(row, flush=True)
                rows.append(row)
    out = Path(a.out) if a.out else report_dir("restore_stall", a.tag)
    out.mkdir(parents=True, exist_ok=True)
    dump_json(out / "run.json", {"machine": machine(), "args": vars(a), "rows": rows})
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
