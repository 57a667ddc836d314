"""The disk prompt cache's directory: one process's at a time, and helpers for its files.

`claim_cache_dir(directory)` takes an exclusive lock on `DIRECTORY/.lock` (`fcntl.flock`, held until
the process exits; a process may claim the same directory again): a second server started on
a directory another one uses gets a clear error instead of the two deleting each other's
files (each indexes only its own writes, and the same sequence written by both under one
name with different parents reads as altered to the other) and each keeping its own cap.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

try:
    import fcntl
except ImportError:             # (no flock: not locked)
    fcntl = None

LOCK = ".lock"
SEGMENT_NAME = re.compile(r"[0-9a-f]{40}")     # a segment file's stem (a hash of its tokens)
_HELD: dict = {}                # the directories this process holds: real path -> fd


class DirectoryInUse(OSError):
    """Another process serves from this directory."""


def claim_cache_dir(directory) -> None:
    """Hold `directory` for this process; DirectoryInUse when another one holds it."""
    d = Path(directory).expanduser()
    key = os.path.realpath(d)
    if key in _HELD or fcntl is None:
        return
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
        except OSError:
            pid = "?"
        os.close(fd)
        raise DirectoryInUse(f"{d} is in use by another process (pid {pid}): one server "
                             f"per prompt cache directory") from None
    except OSError:             # (a file system without locks: not locked)
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[key] = fd


def process_alive(pid: str) -> bool:
    """Whether process `pid` (a file name's part) still runs: its file may still be written."""
    try:
        n = int(pid)
        if n <= 0:                  # (0 and -n name process groups, not a process)
            return False
        os.kill(n, 0)
    except (ValueError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:         # (another user's process)
        return True
    return True


def unlink_quiet(p) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def mtime(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except OSError:       # (deleted meanwhile: skipped when opened)
        return 0


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
