"""Prompt caches on disk, in mlx-lm's file format (`mlx_lm.cache_prompt`,
`mlx_lm.models.cache.save_prompt_cache`).

One `.safetensors` file: each layer's cache state as arrays (`"<layer>.<field>"`; a
quantized cache's keys and values are (packed, scales, biases) triples), with the
metadata (string keys) holding three lists: free-form metadata (`0.<key>`: mlx-lm
writes `model` and `tokenizer_config`), the class name of each layer's cache (`1.<i>`),
and which state entries were Python scalars, strings or None (`2.<j>`).

`load_prompt_cache(path)` returns (caches, metadata) with this engine's cache classes;
`save_prompt_cache(path, caches, metadata)` writes a file mlx-lm's loader reads.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
import threading
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from engine.kv.cache import KVCache, QuantizedKVCache, RotatingKVCache
from engine.kv.crc import crc32

# mlx-lm's class name -> (our class, the fields of its `state`, in order)
FIELDS = {
    "KVCache": (KVCache, ("keys", "values", "offset")),
    "RotatingKVCache": (RotatingKVCache, ("keys", "values", "offset", "keep", "max_size", "_idx")),
    "QuantizedKVCache": (QuantizedKVCache, ("keys", "values", "offset", "group_size", "bits")),
}


class CacheFileError(ValueError):
    """The file is not a prompt cache this engine can use."""


def _state(cache) -> tuple:
    name = type(cache).__name__
    if name not in FIELDS:
        raise CacheFileError(f"cannot save a {name} (saved: {', '.join(FIELDS)})")
    return name, tuple(getattr(cache, f) for f in FIELDS[name][1])


def save_prompt_cache(path, caches: list, metadata: dict | None = None) -> None:
    """Write `caches` (one per layer) and string `metadata` to `path` (.safetensors)."""
    arrays, meta = prompt_cache_payload(caches, metadata)
    mx.save_safetensors(str(path), arrays, meta)


def prompt_cache_payload(caches: list, metadata: dict | None = None) -> tuple[dict, dict]:
    """The (arrays, string metadata) of a prompt cache file holding `caches`."""
    names, states = zip(*(_state(c) for c in caches))
    scalars: list = [""]              # (never empty: tree_flatten would drop it)
    arrays = {}
    for key, v in tree_flatten(list(states)):
        if isinstance(v, mx.array):
            arrays[key] = v
        elif isinstance(v, (bool, int, float)):
            scalars.append((key, "scalar"))
            arrays[key] = mx.array(v)
        elif isinstance(v, str):
            scalars.append((key, "string"))
            arrays[key] = mx.array([ord(ch) for ch in v])
        elif v is None:
            scalars.append((key, "none"))
            arrays[key] = mx.array([])
        else:
            raise CacheFileError(f"cannot save a cache field of type {type(v).__name__}")
    # (a non-empty first list, or tree_unflatten would shift the other two)
    meta = dict(tree_flatten([{"saved_by": "mlx-parity", **(metadata or {})}, list(names),
                              scalars]))
    return arrays, meta


def load_prompt_cache(path) -> tuple[list, dict]:
    """(caches, metadata) from a file written by `save_prompt_cache` or mlx-lm."""
    p = Path(path)
    if not p.is_file():
        raise CacheFileError(f"{p} is not a file")
    try:
        arrays, raw = mx.load(str(p), return_metadata=True)
    except (ValueError, RuntimeError, TypeError) as e:
        raise CacheFileError(f"{p} is not a prompt cache file ({e})") from None
    return caches_from(arrays, raw, p)


def caches_from(arrays: dict, raw: dict, where) -> tuple[list, dict]:
    """(caches, metadata) from a file's arrays and its string metadata."""
    try:
        metadata, names, scalars = tree_unflatten(list(raw.items()))
    except (ValueError, TypeError) as e:
        raise CacheFileError(f"{where} is not a prompt cache file ({e})") from None
    arrays = dict(arrays)
    for key, kind in scalars[1:]:
        a = arrays[key]
        arrays[key] = (a.item() if kind == "scalar" else
                       "".join(chr(i) for i in a.tolist()) if kind == "string" else None)
    states = tree_unflatten(list(arrays.items()))
    caches = []
    for name, state in zip(names, states):
        if name not in FIELDS:
            raise CacheFileError(f"{where}: cache type {name} is not supported "
                                 f"(supported: {', '.join(FIELDS)})")
        cls, fields = FIELDS[name]
        c = cls(0) if cls is RotatingKVCache else cls()
        for f, v in zip(fields, state):
            setattr(c, f, tuple(v) if isinstance(v, list) else v)
        caches.append(c)
    return caches, dict(metadata)


# --- the same files, written and read as bytes with a checksum (engine.kv.disk_cache) ---

DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32",
          mx.int32: "I32", mx.uint8: "U8", mx.int64: "I64", mx.uint16: "U16", mx.bool_: "BOOL"}
CODES = {v: k for k, v in DTYPES.items()}
CHECKSUM = "0.checksum"     # the metadata key of a file's CRC-32


def _crc(meta: dict, entries: dict, data: list) -> str:
    """CRC-32 of the metadata (bar the checksum), the arrays' header entries (dtype, shape,
    offsets: an entry altered would read other bytes as an array) and the data section."""
    head = json.dumps([{k: v for k, v in meta.items() if k != CHECKSUM}, entries], sort_keys=True)
    crc = zlib.crc32(head.encode())
    for d in data:
        crc = crc32(d, crc)         # (a large section on several threads: engine.kv.crc)
    return f"{crc:08x}"


def host_buffers(arrays: dict) -> dict:
    """{key: (dtype code, shape, bytes-like)} of evaluated arrays, for `write_file` (call it
    where MLX runs; the result is plain memory any thread may read). An array whose buffer
    cannot be viewed as it is (not contiguous, or not in host memory) is copied out."""
    out = {}
    for key, a in arrays.items():
        try:
            v = memoryview(a) if a.size else memoryview(b"")
            if not v.c_contiguous:
                raise BufferError("not contiguous")
        except (BufferError, TypeError, ValueError, RuntimeError):
            wide = a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a
            v = memoryview(np.ascontiguousarray(np.array(wide)))
        out[key] = (DTYPES[a.dtype], list(a.shape), v)
    return out


def write_file(path, buffers: dict, meta: dict) -> int:
    """Write a .safetensors file (mlx-lm reads it with `mx.load`) of `host_buffers`' output
    whose metadata carries a checksum of the whole file; returns its size (no MLX call)."""
    header, views, at = {}, [], 0
    for key, (code, shape, v) in buffers.items():
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [at, at + v.nbytes]}
        views.append(v)
        at += v.nbytes
    meta = {**meta, CHECKSUM: _crc(meta, header, views)}
    head = json.dumps({**header, "__metadata__": meta}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for v in views:
            f.write(v)
    return 8 + len(head) + at


def read_header(f) -> tuple[dict, int]:
    """(header, data offset) of an open .safetensors file."""
    try:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 28:
            raise ValueError("header too large")
        header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CacheFileError(f"unreadable header ({e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__") or {}, dict):
        raise CacheFileError("unreadable header (not a safetensors header)")
    return header, 8 + n


def open_regular(path):
    """`path` opened for reading (binary) if it is a regular file; CacheFileError if it is
    anything else (a FIFO, a device, a directory: opening those could block or fail later)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CacheFileError("not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def decode_file(path) -> tuple[list, dict]:
    """(caches, metadata) of a file written by `encode_file`; CacheFileError when it is
    truncated, altered or has no checksum. The file is mapped, not read: the checksum runs
    over the page cache's bytes while each array is copied once, into MLX's memory (a read
    and then a copy took twice as long for a 25K-token prefix; files are only ever
    replaced whole, never changed in place, so the mapping cannot change under us)."""
    with open_regular(path) as f:
        header, start = read_header(f)
        mm = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
              if os.fstat(f.fileno()).st_size > start else None)
    meta = header.pop("__metadata__", None) or {}
    try:
        data = memoryview(mm)[start:] if mm is not None else memoryview(b"")
        try:
            if meta.get(CHECKSUM) is None:
                raise CacheFileError("no checksum")
            # the checksum on a thread (zlib lets go of the GIL) while the arrays are copied
            # out of the same mapping; none of them is returned before it matches
            entries = {key: _entry(h, len(data)) for key, h in header.items()}
            crc: list = []
            check = threading.Thread(target=lambda: crc.append(_crc(meta, header, [data])))
            check.start()
            try:
                arrays = {key: _array(data, *e) for key, e in entries.items()}
            finally:
                check.join()
            if crc != [meta[CHECKSUM]]:
                raise CacheFileError("checksum mismatch (truncated or altered)")
        finally:
            data.release()
    finally:
        if mm is not None:
            mm.close()
    return caches_from(arrays, {k: v for k, v in meta.items() if k != CHECKSUM}, path)


_NP = {"F32": np.float32, "U32": np.uint32, "I32": np.int32, "U8": np.uint8, "I64": np.int64,
       "U16": np.uint16, "BOOL": np.bool_, "BF16": np.uint16, "F16": np.uint16}


def _entry(h, size: int) -> tuple:
    """(offset, end, dtype code, shape) of a header's array entry inside a data section of
    `size` bytes; CacheFileError when it is not one (the checksum covers the entries too,
    but the arrays are copied while it runs: they must first fit the section)."""
    try:
        a, b = (int(v) for v in h["data_offsets"])
        code, shape = h["dtype"], [int(d) for d in h["shape"]]
        itemsize = np.dtype(_NP[code]).itemsize
    except (KeyError, TypeError, ValueError) as e:
        raise CacheFileError(f"unreadable array entry ({type(e).__name__}: {e})") from None
    if (not 0 <= a <= b <= size or min(shape, default=0) < 0
            or b - a != itemsize * math.prod(shape)):
        raise CacheFileError(f"array entry outside the data section or not of its shape's "
                             f"size ({a}, {b}, {shape})")
    return a, b, code, shape


def _array(data: memoryview, a: int, b: int, code: str, shape: list) -> mx.array:
    """One array of a checked file's data section, copied into MLX's memory (the numpy view
    of the mapping is dropped before the mapping is closed)."""
    dtype = np.dtype(_NP[code])
    raw = np.frombuffer(data, dtype=dtype, count=(b - a) // dtype.itemsize, offset=a)
    try:
        x = mx.array(raw)
    finally:
        del raw
    x = x.reshape(shape)
    return x.view(CODES[code]) if code in ("BF16", "F16") else x
