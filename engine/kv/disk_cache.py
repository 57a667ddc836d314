"""Prompt cache on disk: prefixes' KV kept as files that survive a restart.

Each file is one *segment* of a token sequence's KV, in mlx-lm's prompt-cache format
(`engine.kv.cache_file`; `mlx_lm.models.cache.load_prompt_cache` reads it): the K/V of
tokens [start, end) of every layer, plus metadata naming its parent file (the segment
before it, of which the first `start` tokens are used), its own token ids, the model
fingerprint, the KV type, the adapter set (`ns`) and a CRC-32 of the whole file. A
segment with no parent is a complete prompt cache of its tokens. A new sequence writes
only the tokens no file holds yet (the part past its longest prefix already on disk),
so a growing agent session writes each turn's new tokens once.

Index: at start the directory's headers are read (not the K/V); files of another model
or KV type, unreadable headers and orphans are ignored with one log line each. The token
sequences go into one radix tree per adapter set (`engine.kv.prefix_tree`); a lookup
walks the prompt's path in RAM, and only a hit reads files (each verified against its
checksum; a bad one is deleted with its descendants, logged once, and the request runs
cold). Every file of a chain is a prefix of plain (unwrapped) caches, so any prefix of
a chain can be restored: K/V cut to it are the same bytes a cold prefill left there.

Not stored (counted in `refused`, logged once per reason): sequences shorter than
`min_tokens`, a sliding-window ring that has wrapped (it no longer holds its prefix's
K/V), caches of a type the file format has no name for. Writes run on a background
thread; `flush()` waits for them. Size: the files' bytes, capped at `max_bytes`; the least
recently used file that no other file continues is deleted first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .cache_file import (FIELDS, CacheFileError, decode_file, host_buffers, open_regular,
                         prompt_cache_payload, read_header, write_file)
from .disk_dir import (SEGMENT_NAME, claim_cache_dir, fingerprint, mtime, process_alive,
                       unlink_quiet)
from .prefix_tree import PrefixTree

log = logging.getLogger("engine.kv.prompt_cache")

FORMAT = "mlx-parity-segment-2"    # (2: the checksum covers the arrays' header entries)
OLD_FORMATS = ("mlx-parity-segment-1",)
SUFFIX = ".safetensors"
TMP = ".tmp"
MIN_TOKENS = 64


def disk_cache_for(directory, disk_gb: float, model_dir, engine, adapter_path=None) -> "DiskCache":
    """The disk cache of an `engine.Engine` loaded from `model_dir` (plus a fused adapter):
    files of another model, KV setting or mode (deterministic: its KV rounds otherwise) are
    not used."""
    if not (disk_gb > 0 and math.isfinite(disk_gb)):
        raise ValueError(f"prompt cache disk size must be a finite number > 0 GB (got {disk_gb!r})")
    kv = json.dumps([sorted(engine.policy.layers.items()), engine.policy.start,
                     engine.max_kv_size] + (["deterministic"] if engine.deterministic else []))
    model = fingerprint(model_dir, *([adapter_path] if adapter_path else []))
    return DiskCache(directory, int(disk_gb * 1e9), model, kv)


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}   # a full disk or quota


def _cut(x, a: int, b: int):
    """Tokens [a, b) of K or V (a copy; `x` itself when that is all of it)."""
    if isinstance(x, (tuple, list)):
        return tuple(_cut(t, a, b) for t in x)
    if a == 0 and b == x.shape[-2]:
        return x
    return mx.contiguous(x[..., a:b, :])


def _cat(parts):
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], (tuple, list)):
        return tuple(mx.concatenate(list(leaves), axis=2) for leaves in zip(*parts))
    return mx.concatenate(parts, axis=2)


def _with(c, keys, values, n: int):
    """A cache like `c` holding `keys`/`values` of n tokens (slot i = token i)."""
    out = c.copy()
    out.keys, out.values, out.offset = keys, values, n
    if hasattr(out, "_idx"):
        out._idx = n
    return out


class _File:
    __slots__ = ("name", "ns", "parent", "start", "end", "size", "node", "ready")

    def __init__(self, name, ns, parent, start, end, size, ready=True):
        self.name, self.ns, self.parent, self.start, self.end = name, ns, parent, start, end
        self.size, self.ready, self.node = size, ready, None


class DiskCache:
    def __init__(self, directory, max_bytes: int, model: str, kv: str = "",
                 min_tokens: int = MIN_TOKENS, background: bool = True):
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        claim_cache_dir(self.dir)
        self.max_bytes, self.model, self.kv = int(max_bytes), model, kv
        self.min_tokens = max(2, int(min_tokens))
        self.lock = threading.Lock()
        self._files: "OrderedDict[str, _File]" = OrderedDict()     # LRU order
        self._trees: dict = {}
        self._children: dict = {}
        self._bytes = 0
        self.hits = self.misses = self.evictions = self.writes = self.write_errors = 0
        self.tokens_restored = self.bytes_read = self.bytes_written = self.last_write_bytes = 0
        self.last_restore_ms = 0.0      # the last hit's read, checks and arrays, wall time
        self.ignored: dict = {}     # reason -> files ignored (another model, corrupted, ...)
        self.refused: dict = {}     # reason -> sequences not stored
        self._q: "queue.Queue" = queue.Queue()
        self._background = background
        self._thread: Optional[threading.Thread] = None
        self._scan()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def _longest(self) -> Optional[_File]:
        return max(self._files.values(), key=lambda f: f.end, default=None)

    def longest_chain(self) -> tuple:
        """(tokens, [its files' paths, root first]) of the longest stored prefix: what the
        first turn after a restart restores ((0, []) when nothing is stored)."""
        with self.lock:
            top = self._longest()
            if top is None:
                return 0, []
            return top.end, [self.dir / (f.name + SUFFIX) for f, _ in self._chain(top.name, top.end)]

    def longest_ids(self) -> list:
        """The token ids of the longest stored prefix ([] when nothing is stored)."""
        with self.lock:
            top = self._longest()
            return [] if top is None or top.node is None else list(top.node.tokens())

    # --- index ----------------------------------------------------------------------

    def _ignore(self, path, reason: str, detail: str = "") -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1
        log.warning("prompt cache: ignoring %s: %s%s", path, reason, f" ({detail})" if detail else "")

    def _scan(self) -> None:
        for p in self.dir.glob("*" + TMP):      # a write its process never finished (killed)
            if not p.is_file() or p.is_symlink():
                self._ignore(p, "not a file")
            elif not process_alive(p.name.split(".")[-2]):
                self._ignore(p, "an unfinished write", "deleted")
                unlink_quiet(p)
        found = {}
        for p in sorted(self.dir.glob("*" + SUFFIX), key=mtime):
            try:
                with open_regular(p) as f:
                    header, _ = read_header(f)
                meta = header.get("__metadata__") or {}
                if meta.get("0.format") in OLD_FORMATS:
                    self._ignore(p, "an older format of this cache", "deleted")
                    unlink_quiet(p)
                elif meta.get("0.format") != FORMAT:
                    self._ignore(p, "not a segment of this cache")
                elif meta.get("0.model") != self.model:
                    self._ignore(p, "another model")
                elif meta.get("0.kv") != self.kv:
                    self._ignore(p, "another KV type", meta.get("0.kv"))
                else:
                    found[p.stem] = (meta, p.stat().st_size)
            except CacheFileError as e:
                if SEGMENT_NAME.fullmatch(p.stem):     # (a file of ours, cut short: of no use)
                    self._ignore(p, "unreadable", f"{e}; deleted")
                    unlink_quiet(p)
                else:
                    self._ignore(p, "unreadable", str(e))
            except OSError as e:
                self._ignore(p, "unreadable", str(e))
        tokens: dict = {}           # name -> its whole token sequence (None: unusable)
        for name in found:
            path = [name]           # the file, then its ancestors not resolved yet
            while path[-1] not in tokens:
                tokens[path[-1]] = None
                parent = found[path[-1]][0].get("0.parent") or None
                if parent is None or parent in tokens or parent not in found:
                    break
                path.append(parent)
            for n in reversed(path):
                tokens[n] = self._index(n, found[n], tokens)
        self._evict()

    def _index(self, name: str, found, tokens: dict):
        """Index one scanned file whose parent (if any) was indexed before; its sequence."""
        meta, size = found
        try:
            own = json.loads(meta["0.tokens"])
            if not isinstance(own, list) or not all(type(t) is int and 0 <= t < 1 << 31
                                                    for t in own):
                raise ValueError("0.tokens is not a list of token ids")
            parent, start = meta.get("0.parent") or None, int(meta["0.start"])
            head = [] if parent is None else tokens.get(parent)
            if head is None or len(head) < start:    # (of no use without it: deleted)
                self._ignore(self.dir / (name + SUFFIX), "its parent segment is missing",
                             "deleted")
                unlink_quiet(self.dir / (name + SUFFIX))
                return None
            seq = head[:start] + own
            self._add(_File(name, meta["0.ns"], parent, start, len(seq), size), seq)
            return seq
        except (KeyError, ValueError, TypeError) as e:      # (ours, this model's: deleted)
            self._ignore(self.dir / (name + SUFFIX), "unreadable", f"metadata {e}; deleted")
            unlink_quiet(self.dir / (name + SUFFIX))
            return None

    def _add(self, f: _File, tokens) -> None:
        tree = self._trees.setdefault(f.ns, PrefixTree())
        f.node = tree.insert(tuple(tokens))
        if f.node.entry is not None:     # the same sequence twice: keep the first
            return
        tree.set_entry(f.node, f.name, True)
        self._files[f.name] = f
        self._children.setdefault(f.parent, set()).add(f.name)
        self._bytes += f.size

    def _forget(self, name: str, delete: bool = True) -> None:
        """Drop a file and every file that continues it (index and disk)."""
        for child in list(self._children.pop(name, ())):
            self._forget(child, delete)
        f = self._files.pop(name, None)
        if f is None:
            return
        self._children.get(f.parent, set()).discard(name)
        self._bytes -= f.size
        tree = self._trees[f.ns]
        tree.clear_entry(f.node)
        if tree.empty():
            del self._trees[f.ns]
        if delete:
            try:
                os.unlink(self.dir / (name + SUFFIX))
            except OSError:
                pass

    def _evict(self) -> None:
        """Least recently used *leaves* first (a file others continue stays while they do):
        a shared prefix (the system prompt and tools) outlives the conversations on it."""
        while self._bytes > self.max_bytes:
            victim = next((n for n, f in self._files.items()
                           if f.ready and not self._children.get(n)), None)
            if victim is None:
                return
            self._forget(victim)
            self.evictions += 1

    def _match(self, ns: str, tokens: tuple, limit: int):
        """(tokens shared with a file's sequence, that file) for tokens[:limit]."""
        tree = self._trees.get(ns)
        if tree is None:
            return 0, None
        m = tree.match(tokens, limit)
        if m.trim is None:
            return 0, None
        return m.trim_len, tree.trimmable_below(m.trim).entry

    def _chain(self, name: str, n: int) -> list:
        """[(file, tokens of its segment to use)], root first, covering tokens [0, n)."""
        out = []
        while name is not None:
            f = self._files[name]
            if n > f.start:
                out.append((f, min(n, f.end) - f.start))
            n = min(n, f.start)
            name = f.parent
        return out[::-1]

    # --- restore ----------------------------------------------------------------------

    def _check(self, meta: dict, f: _File, tokens: list) -> None:
        """The verified file is the one indexed, and its tokens are the prompt's."""
        own = json.loads(meta["tokens"])
        if ((meta["model"], meta["kv"], meta["ns"], meta["parent"] or None, int(meta["start"]))
                != (self.model, self.kv, f.ns, f.parent, f.start)
                or f.start + len(own) != f.end or own[:len(tokens)] != list(tokens)):
            raise CacheFileError("its metadata no longer matches the index")

    def restore(self, ns: str, prompt, more_than: int = 0):
        """(caches, tokens reused) for the longest prefix of `prompt` on disk (always
        leaving one token to compute), or None: when it would not reuse more than
        `more_than` tokens (counted as a miss), or a file fails its checks (logged, deleted).
        Never raises: whatever goes wrong, the request runs cold."""
        try:
            return self._restore(ns, prompt, more_than)
        except Exception as e:      # (a cache must never fail the request it serves)
            log.warning("prompt cache: restore failed (%s: %s); running cold",
                        type(e).__name__, e)
            with self.lock:
                self.misses += 1
            return None

    def _restore(self, ns: str, prompt, more_than: int):
        t0 = time.perf_counter()
        with self.lock:
            n, name = self._match(ns, tuple(prompt), len(prompt) - 1)
            if name is None or n < self.min_tokens or n <= more_than:
                self.misses += 1
                return None
            chain = self._chain(name, n)
            pending = not all(f.ready for f, _ in chain)
        if pending:
            self.flush()
        parts, read = [], 0
        for f, take in chain:
            path = self.dir / (f.name + SUFFIX)
            try:
                caches, meta = decode_file(path)
                self._check(meta, f, prompt[f.start:f.start + take])
                if any(c.offset < take for c in caches):
                    raise CacheFileError("holds fewer tokens than its metadata says")
            except FileNotFoundError:
                with self.lock:
                    self._forget(f.name, delete=False)
                    self.misses += 1
                return None
            except (OSError, CacheFileError, KeyError, ValueError) as e:
                with self.lock:
                    self._ignore(path, "corrupted", f"{type(e).__name__}: {e}")
                    self._forget(f.name)
                    self.misses += 1
                return None
            read += f.size
            parts.append([(c, _cut(c.keys, 0, take), _cut(c.values, 0, take)) for c in caches])
        out = []
        for layer in zip(*parts):
            c = layer[0][0]
            keys = _cat([k for _, k, _ in layer])
            values = _cat([v for _, _, v in layer])
            out.append(_with(c, keys, values, n))
        mx.eval([x for c in out for x in (c.keys, c.values)])
        with self.lock:
            self.hits += 1
            self.last_restore_ms = round((time.perf_counter() - t0) * 1e3, 1)
            self.tokens_restored += n
            self.bytes_read += read
            for f, _ in chain:
                if f.name in self._files:
                    self._files.move_to_end(f.name)
        for f, _ in chain:
            try:
                os.utime(self.dir / (f.name + SUFFIX))   # the LRU order after a restart
            except OSError:
                pass
        return out, n

    # --- store ------------------------------------------------------------------------

    def _refuse(self, reason: str) -> None:
        if reason not in self.refused:
            log.warning("prompt cache: not writing to disk: %s", reason)
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def store(self, ns: str, tokens, caches: list) -> int:
        """Queue the part of `tokens`' KV (held by `caches`, exactly those tokens) that no
        file holds yet; returns the K/V bytes it will write (0: nothing new or refused).
        The file is written on a background thread (`flush()` waits for it). Never raises."""
        try:
            return self._store(ns, tokens, caches)
        except Exception as e:      # (a cache must never fail the request it serves)
            self._refuse(f"error ({type(e).__name__}: {e})")
            return 0

    def _store(self, ns: str, tokens, caches: list) -> int:
        tokens = list(tokens)
        if len(tokens) < self.min_tokens or not caches:
            return 0
        if any(type(c).__name__ not in FIELDS for c in caches):
            self._refuse(f"cache type {type(caches[0]).__name__} has no file format name")
            return 0
        if not all(c.is_trimmable() for c in caches):
            self._refuse("a sliding-window cache has wrapped (its prefix is gone)")
            return 0
        with self.lock:
            start, parent = self._match(ns, tuple(tokens), len(tokens))
            if start >= len(tokens):
                return 0
            name = hashlib.sha256(json.dumps([self.model, self.kv, ns, tokens]).encode()
                                  ).hexdigest()[:40]
        end = len(tokens)
        seg = [_with(c, _cut(c.keys, start, end), _cut(c.values, start, end), end - start)
               for c in caches]
        arrays, meta = prompt_cache_payload(seg, {
            "format": FORMAT, "model": self.model, "kv": self.kv, "ns": ns,
            "parent": parent or "", "start": str(start), "tokens": json.dumps(tokens[start:])})
        arrays = {k: mx.contiguous(a) for k, a in arrays.items()}
        mx.eval(list(arrays.values()))
        buffers = host_buffers(arrays)
        size = sum(a.nbytes for a in arrays.values())    # (the header's bytes come later)
        if size > self.max_bytes:
            self._refuse(f"a file larger than the cap ({self.max_bytes / 1e9:.3g} GB)")
            return 0
        with self.lock:
            if start and parent not in self._files:     # evicted meanwhile
                return 0
            f = _File(name, ns, parent, start, end, size, ready=False)
            self._add(f, tokens)
            if self._files.get(name) is not f:
                return 0
            for g, _ in self._chain(parent, start) if parent else ():
                self._files.move_to_end(g.name)
            self._files.move_to_end(name)
        self._q.put((f, (buffers, meta)))
        if not self._background:
            self._drain()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="prompt-cache-disk",
                                            daemon=True)
            self._thread.start()
        return size

    def _write(self, f: _File, payload) -> None:
        path = self.dir / (f.name + SUFFIX)
        tmp = self.dir / f"{f.name}.{os.getpid()}{TMP}"     # (the writer's pid: see _scan)
        try:
            size = write_file(tmp, *payload)
            os.replace(tmp, path)
        except Exception as e:      # (the writer thread must live on: flush() waits for it)
            unlink_quiet(tmp)
            log.warning("prompt cache: cannot write %s (%s)", path, e)
            with self.lock:
                self._forget(f.name, delete=False)
                self.write_errors += 1
                if isinstance(e, OSError) and e.errno in _FULL:
                    # the disk holds less than the cap: the cap becomes what it holds now
                    cap = int(self._bytes * 0.9)
                    if cap < self.max_bytes:
                        log.warning("prompt cache: %s is full; keeping at most %.3f GB there "
                                    "from now on", self.dir, cap / 1e9)
                        self.max_bytes = cap
                        self._evict()
            return
        with self.lock:
            if self._files.get(f.name) is not f:     # evicted with its parent meanwhile
                path.unlink(missing_ok=True)
                return
            f.ready = True
            self._bytes += size - f.size
            f.size = size
            self.writes += 1
            self.bytes_written += size
            self.last_write_bytes = size
            self._evict()

    def _writer(self) -> None:
        while True:
            f, payload = self._q.get()
            try:
                self._write(f, payload)
            except Exception as e:      # (never: _write catches; the thread must not die)
                log.warning("prompt cache: writer error (%s)", e)
            finally:
                self._q.task_done()

    def _drain(self) -> None:
        while not self._q.empty():
            f, payload = self._q.get()
            self._write(f, payload)
            self._q.task_done()

    def flush(self) -> None:
        """Wait until every queued file is written."""
        if self._background and self._thread is not None:
            self._q.join()
        else:
            self._drain()

    def stats(self) -> dict:
        return {"enabled": True, "max_bytes": self.max_bytes, "bytes": self._bytes,
                "files": len(self._files), "hits": self.hits, "misses": self.misses,
                "tokens_restored": self.tokens_restored, "bytes_read": self.bytes_read,
                "last_restore_ms": self.last_restore_ms,
                "writes": self.writes, "write_errors": self.write_errors,
                "bytes_written": self.bytes_written,
                "last_write_bytes": self.last_write_bytes, "evictions": self.evictions,
                "ignored": dict(self.ignored), "refused": dict(self.refused)}
