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


def layer_kv(i: int, kv_heads: int, head_dim: int, tokens: int):
    """Layer i's K and V (random, bf16; the same every call)."""
    import mlx.core as mx
    shape = (1, kv_heads, tokens, head_dim)
    return tuple(mx.random.normal(shape, key=mx.random.key(2 * i + j)).astype(mx.bfloat16)
                 for j in (0, 1))


def session_caches(layers: int, kv_heads: int, head_dim: int, tokens: int):
    import mlx.core as mx
    from engine.kv.cache import KVCache
    caches = []
    for i in range(layers):
        c = KVCache()
        c.update_and_fetch(*layer_kv(i, kv_heads, head_dim, tokens))
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
    ap.add_argument("--out", default=None, help="report directory (default: reports/disk_restore/<version>/<tag>)")
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
        parts = {"read_s": [], "checksum_s": [], "restore_s": [], "equal": []}
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
            if not parts["equal"]:      # (once: every restored K/V bit-equal to what was stored)
                parts["equal"].append(all(
                    mx.array_equal(x, y).item() for i, c in enumerate(got[0])
                    for x, y in zip((c.keys[..., :total, :], c.values[..., :total, :]),
                                    layer_kv(i, a.kv_heads, a.head_dim, total))))
            del got
    row = {"tag": a.tag, "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
           "tokens": total, "files": len(files), "bytes": size, "write_s": round(write_s, 3),
           "read_s_sum": round(sum(statistics.median(parts["read_s"][i::len(files)])
                                   for i in range(len(files))), 4),
           "checksum_s_sum": round(sum(statistics.median(parts["checksum_s"][i::len(files)])
                                       for i in range(len(files))), 4),
           "restore_s": round(statistics.median(parts["restore_s"]), 4),
           "restore_gb_s": round(size / 1e9 / statistics.median(parts["restore_s"]), 2),
           "restore_trials_s": [round(x, 4) for x in parts["restore_s"]],
           "bit_equal": parts["equal"] == [True]}
    print(row, flush=True)
    out = Path(a.out) if a.out else report_dir("disk_restore", a.tag)
    out.mkdir(parents=True, exist_ok=True)
    dump_json(out / "run.json", {"machine": machine(), "args": vars(a), "result": row})
    print(f"wrote {out}")
    return row


def _prefix(c, n: int):
    from engine.kv.cache import KVCache
    out = KVCache()
    out.keys, out.values, out.offset = c.keys[..., :n, :], c.values[..., :n, :], n
    return out


if __name__ == "__main__":
    main()
