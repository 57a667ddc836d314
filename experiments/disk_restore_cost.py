"""What reading a prefix back from the disk prompt cache costs, part by part.

An agent's turn after a restart reads its prefix's KV from files (`engine.kv.disk_cache`):
on a GPU a 25K-token prefix of a 1B model is ~820 MB, and a cold prefill of it takes about
half a second on an H100, so the read must be fast to be worth it. This writes a session's
chain of segment files (a first prompt of `--tokens`, then `--turns` segments of
`--turn-tokens`) for a model's KV shape (random bf16 K/V, `--layers`, `--kv-heads`,
`--head-dim`), then, as a restarted server does, indexes the directory afresh and restores
the whole chain `--trials` times (median), with each part timed on its own: reading the
bytes, the checksum, building the arrays on the device, cutting and joining the segments.

    python experiments/disk_restore_cost.py                       # 1B-shaped, 25K tokens
    python experiments/disk_restore_cost.py --layers 32 --head-dim 128 --tag 8b

Writes run.json to reports/disk_restore/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments._common import dump_json, machine, report_dir  # noqa: E402


def session_caches(layers: int, kv_heads: int, head_dim: int, tokens: int):
    import mlx.core as mx
    from engine.kv.cache import KVCache
    caches = []
    for i in range(layers):
        c = KVCache()
        k = mx.random.normal((1, kv_heads, tokens, head_dim), key=mx.random.key(2 * i))
        v = mx.random.normal((1, kv_heads, tokens, head_dim), key=mx.random.key(2 * i + 1))
        c.update_and_fetch(k.astype(mx.bfloat16), v.astype(mx.bfloat16))
        caches.append(c)
    mx.eval([x for c in caches for x in (c.keys, c.values)])
    return caches


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=25000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=400)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--tag", default="1b")
    a = ap.parse_args(argv)
    import mlx.core as mx
    from engine.kv.cache_file import read_header
    from engine.kv.disk_cache import DiskCache
    total = a.tokens + a.turns * a.turn_tokens
    caches = session_caches(a.layers, a.kv_heads, a.head_dim, total)
    ids = [(7 * i + 3) % 30000 for i in range(total)]
    with tempfile.TemporaryDirectory(prefix="disk-restore-", dir=a.dir) as tmp:
        disk = DiskCache(tmp, int(1e12), "m")
        t0 = time.perf_counter()
        for n in [a.tokens + t * a.turn_tokens for t in range(a.turns + 1)]:
            disk.store("", ids[:n], [_prefix(c, n) for c in caches])
        disk.flush()
        write_s = time.perf_counter() - t0
        files = sorted(Path(tmp).glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        del caches
        parts = {"read_s": [], "checksum_s": [], "restore_s": []}
        for _ in range(a.trials):
            for f in files:         # the parts alone: the bytes, then their CRC-32
                t0 = time.perf_counter()
                with open(f, "rb") as fh:
                    _, start = read_header(fh)
                    data = fh.read()
                parts["read_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                zlib.crc32(data)
                parts["checksum_s"].append(time.perf_counter() - t0)
                del data
            fresh = DiskCache(tmp, int(1e12), "m")      # a restarted server's index
            t0 = time.perf_counter()
            got = fresh.restore("", ids + [1], 0)
            mx.eval([x for c in got[0] for x in (c.keys, c.values)])
            mx.synchronize()
            parts["restore_s"].append(time.perf_counter() - t0)
            assert got[1] == total, got[1]
            del got
    row = {"tag": a.tag, "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
           "tokens": total, "files": len(files), "bytes": size, "write_s": round(write_s, 3),
           "read_s_sum": round(sum(statistics.median(parts["read_s"][i::len(files)])
                                   for i in range(len(files))), 4),
           "checksum_s_sum": round(sum(statistics.median(parts["checksum_s"][i::len(files)])
                                       for i in range(len(files))), 4),
           "restore_s": round(statistics.median(parts["restore_s"]), 4),
           "restore_gb_s": round(size / 1e9 / statistics.median(parts["restore_s"]), 2),
           "restore_trials_s": [round(x, 4) for x in parts["restore_s"]]}
    print(row, flush=True)
    out = report_dir("disk_restore", a.tag)
    dump_json(out / "run.json", {"machine": machine(), "args": vars(a), "result": row})
    print(f"wrote {out}")


def _prefix(c, n: int):
    from engine.kv.cache import KVCache
    out = KVCache()
    out.keys, out.values, out.offset = c.keys[..., :n, :], c.values[..., :n, :], n
    return out


if __name__ == "__main__":
    main()
