"""What bounds a disk prompt cache restore: each step of it timed alone, on one big buffer.

On the H100 host a restore reads ~1.5-2.2 GB/s whatever the reader (threads, CRC pieces,
`mx.load`: reports/prompt_cache_disk/JOURNAL.md, 0.6.3), so the bound is one the readers
share. Candidates, each timed here over `--mb` MB (a file written first, in the page cache):

    read_fresh    f.readinto() into a new numpy buffer (the page cache copied; the buffer's
                  pages faulted in on first touch)
    read_again    the same into the buffer already touched
    mmap_copy     np.copyto from a fresh mapping of the file (its pages faulted in) to that buffer
    crc1          zlib.crc32 over the buffer, one thread
    crcN          the same in 32 MB pieces on N threads (the CRCs not combined: the speed only)
    mx_array      mx.array(buffer): MLX allocates and copies (on CUDA: into its memory, which
                  the CPU writes first)
    mx_again      the same again after the first array is freed (MLX's buffer cache reused)
    mx_gpu        mx.eval of a GPU op over the array (its pages moved to the GPU)
    mx_zeros      mx.zeros of that size, evaluated (MLX allocates and fills: fresh pages faulted)
    copy_into     np.copyto into that array's memory (a numpy view of it), already touched
    cache_mb      MLX's buffer cache after an array of that size is freed (0: not kept)

    python experiments/restore_bound_probe.py --mb 800 --threads 8
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=800)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    n = a.mb << 20
    res = {"device": str(mx.default_device()), "mb": a.mb}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = os.path.join(tmp, "blob")
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).tobytes())
        with open(path, "rb") as f:        # (in the page cache now)
            f.readinto(np.empty(n, np.uint8))

        def read_into(buf):
            with open(path, "rb", buffering=0) as f:
                return f.readinto(buf)
        res["read_fresh_s"], _ = timed(lambda: read_into(np.empty(n, np.uint8)))
        buf = np.empty(n, np.uint8)
        read_into(buf)
        res["read_again_s"], _ = timed(lambda: read_into(buf))

        def mmap_copy():
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                src = np.frombuffer(mm, np.uint8)
                np.copyto(buf, src)
                del src
                mm.close()
        res["mmap_copy_s"], _ = timed(mmap_copy)
        res["crc1_s"], _ = timed(lambda: zlib.crc32(buf))
        piece = 32 << 20
        with ThreadPoolExecutor(a.threads) as ex:
            res[f"crc{a.threads}_s"], _ = timed(lambda: list(ex.map(
                lambda i: zlib.crc32(buf[i:i + piece]), range(0, n, piece))))
        bf = buf.view(np.uint16)
        res["mx_array_s"], x = timed(lambda: mx.eval(y := mx.array(bf)) or y)
        del x
        res["mx_again_s"], x = timed(lambda: mx.eval(y := mx.array(bf)) or y)
        res["mx_gpu_s"], _ = timed(lambda x=x: mx.eval((x + 1).sum()))
        del x
        # (2-D: one dimension of n bytes would not fit MLX's int32 shape at 3+ GB)
        res["mx_zeros_s"], z = timed(lambda: mx.eval(y := mx.zeros((n >> 20, 1 << 20), mx.uint8)) or y)
        view = np.array(z, copy=False).reshape(-1)
        res["copy_into_s"], _ = timed(lambda view=view: np.copyto(view, buf))
        del view, z
        res["cache_mb"] = mx.get_cache_memory() >> 20
    res.update({k.replace("_s", "_gb_s"): round(a.mb / 1024 / v, 2)
                for k, v in list(res.items()) if k.endswith("_s")})
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))


if __name__ == "__main__":
    main()
