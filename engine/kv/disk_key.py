"""Keys of the disk prompt cache (`engine.kv.disk_cache`): a model's fingerprint, and the
cache of an Engine whose files only that model, KV setting and mode may use."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .disk_cache import DiskCache


def fingerprint(*paths, extra: str = "") -> str:
    """A model's identity: config.json's bytes and every file's name, size and mtime
    (top level of each directory given; files as given)."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        p = Path(p)
        for f in sorted(p.iterdir()) if p.is_dir() else [p]:
            if f.is_file():
                st = f.stat()
                h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns};".encode())
                if f.name == "config.json":
                    h.update(f.read_bytes())
    return h.hexdigest()[:32]


def disk_cache_for(directory, disk_gb: float, model_dir, engine, adapter_path=None) -> "DiskCache":
    """The disk cache of an `engine.Engine` loaded from `model_dir` (plus a fused adapter):
    files of another model, KV setting or mode (deterministic: its KV rounds otherwise) are
    not used."""
    if not disk_gb > 0:
        raise ValueError(f"prompt cache disk size must be > 0 GB (got {disk_gb!r})")
    kv = json.dumps([sorted(engine.policy.layers.items()), engine.policy.start,
                     engine.max_kv_size] + (["deterministic"] if engine.deterministic else []))
    model = fingerprint(model_dir, *([adapter_path] if adapter_path else []))
    return DiskCache(directory, int(disk_gb * 1e9), model, kv)
