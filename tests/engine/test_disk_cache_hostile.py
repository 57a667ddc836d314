"""The disk prompt cache against a hostile directory (found by a probe of engine-serve,
0.6.3): an altered header entry that still fits its bytes, FIFOs and directories where
files should be, headers that are JSON but not a header, failed writes, a full disk, a
malformed entry, orphans and files of an older format, a file larger than the cap, and a
second process on the same directory. Each: never a wrong answer, a hang or an exception
out of the cache; one log line; what cannot be used again is deleted."""

import errno
import json
import os
import struct
import threading

import mlx.core as mx
import pytest

from engine import DiskCache
from engine.kv.cache import KVCache
from engine.kv.disk_cache import SUFFIX

ONE, TWO = list(range(100, 200)), list(range(300, 400))


def _kv(n: int, tag: float):
    c = KVCache()
    c.keys = mx.full((1, 1, n, 64), tag)
    c.values = mx.full((1, 1, n, 64), tag + 0.5)     # (keys and values differ)
    c.offset = n
    return [c]


def files(d):
    return sorted(p for p in d.iterdir() if p.name.endswith(SUFFIX))


def _cache(d, **kw):
    return DiskCache(d, kw.pop("max_bytes", 1 << 30), model="m", background=False, **kw)


def _rewrite_header(path, change):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = change(json.loads(raw[8:8 + n]))
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def _within(seconds, fn):
    """fn() on a thread; its result, or a failure if it has not returned in time."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    return out[0]


def _swap_kv(h):
    k = next(k for k in h if k.endswith(".0") and k != "__metadata__")
    v = k[:-2] + ".1"
    h[k]["data_offsets"], h[v]["data_offsets"] = h[v]["data_offsets"], h[k]["data_offsets"]
    return h


def _relabel(h):
    for k, e in h.items():
        if k != "__metadata__" and e["dtype"] == "F32":
            e["dtype"], e["shape"] = "BF16", e["shape"][:-1] + [2 * e["shape"][-1]]
    return h


@pytest.mark.parametrize("change", [_swap_kv, _relabel], ids=["keys_values_swapped", "dtype"])
def test_an_entry_altered_to_other_bytes_of_the_same_size_is_caught(tmp_path, change):
    """Entries that still fit their bytes (keys' and values' offsets swapped; float32 read
    as bfloat16 of twice the columns) read valid bytes as the wrong array: a wrong answer
    with no log line until the checksum covered the entries (format 2)."""
    dc = _cache(tmp_path)
    dc.store("base", ONE, _kv(100, 1.0))
    (bad,) = files(tmp_path)
    dc.store("base", TWO, _kv(100, 2.0))
    _rewrite_header(bad, change)
    again = _cache(tmp_path)
    assert again.restore("base", ONE + [1]) is None
    assert again.ignored == {"corrupted": 1} and not bad.exists()
    caches, n = again.restore("base", TWO + [1])
    assert n == 100 and mx.array_equal(caches[0].values, mx.full((1, 1, 100, 64), 2.5)).item()


def test_a_malformed_entry_is_corrupted_and_deleted_so_the_prefix_is_written_again(tmp_path):
    """data_offsets that are not a pair made the reader raise a TypeError that the restore
    did not count as a damaged file: it was never deleted, so the prefix never came back."""
    dc = _cache(tmp_path)
    dc.store("base", ONE, _kv(100, 1.0))
    (bad,) = files(tmp_path)

    def change(h):
        h[next(k for k in h if k != "__metadata__")]["data_offsets"] = 5
        return h
    _rewrite_header(bad, change)
    again = _cache(tmp_path)
    assert again.restore("base", ONE + [1]) is None
    assert again.ignored == {"corrupted": 1} and not bad.exists()
    assert again.store("base", ONE, _kv(100, 1.0)) > 0 and again.writes == 1
    assert _cache(tmp_path).restore("base", ONE + [1])[1] == 100


def test_a_fifo_named_like_a_file_never_blocks_the_scan_or_a_restore(tmp_path):
    """open() of a FIFO blocks until a writer comes: at the start's scan (the server never
    got ready) or in a restore (every request behind it hung)."""
    fifo = tmp_path / ("f" * 40 + SUFFIX)
    os.mkfifo(fifo)
    dc = _within(10, lambda: _cache(tmp_path))
    assert dc.ignored == {"unreadable": 1} and not fifo.exists()   # (named as ours: deleted)
    dc.store("base", ONE, _kv(100, 1.0))
    (good,) = files(tmp_path)
    again = _cache(tmp_path)
    good.unlink()
    os.mkfifo(good)
    assert _within(10, lambda: again.restore("base", ONE + [1])) is None
    assert again.ignored == {"corrupted": 1} and not good.exists()


@pytest.mark.parametrize("head", [b"[]", b'{"__metadata__":"x"}', b"7"])
def test_a_header_that_is_json_but_not_a_header_is_ignored(tmp_path, head):
    head += b" " * (-len(head) % 8)
    (tmp_path / ("e" * 40 + SUFFIX)).write_bytes(struct.pack("<Q", len(head)) + head)
    dc = _cache(tmp_path)
    assert dc.ignored == {"unreadable": 1} and len(dc) == 0
    assert not (tmp_path / ("e" * 40 + SUFFIX)).exists()      # (ours by its name: deleted)


def test_tmp_entries_that_are_directories_or_name_no_process(tmp_path):
    """A directory named like an unfinished write crashed the start (unlink of a
    directory); pid 0 named the caller's process group, so its file was never deleted."""
    (tmp_path / f"{'a' * 40}.999999999.tmp").mkdir()
    zero = tmp_path / f"{'b' * 40}.0.tmp"
    zero.write_bytes(b"\0" * 10)
    dc = _cache(tmp_path)
    assert dc.ignored == {"not a file": 1, "an unfinished write": 1} and not zero.exists()


def test_orphans_old_formats_and_cut_files_of_ours_are_deleted_at_the_scan(tmp_path):
    """A segment whose parent is gone, a file of format 1 and a file of ours cut short are
    of no use: deleted at the start (they were kept, uncounted, and logged at every start);
    a foreign file is kept."""
    dc = _cache(tmp_path)
    dc.store("base", ONE, _kv(100, 1.0))
    (parent,) = files(tmp_path)
    dc.store("base", ONE + TWO, _kv(200, 1.0))
    (child,) = [p for p in files(tmp_path) if p != parent]
    parent.unlink()
    old = _cache(tmp_path / "o")
    old.store("base", ONE, _kv(100, 3.0))
    (legacy,) = files(tmp_path / "o")
    _rewrite_header(legacy, lambda h: {**h, "__metadata__": {
        **h["__metadata__"], "0.format": "mlx-parity-segment-1"}})
    legacy = legacy.rename(tmp_path / legacy.name)
    cut = tmp_path / ("d" * 40 + SUFFIX)
    cut.write_bytes(b"\x10\x00")
    foreign = tmp_path / "mine.safetensors"
    mx.save_safetensors(str(foreign), {"x": mx.zeros(3)})
    again = _cache(tmp_path)
    assert not child.exists() and not legacy.exists() and not cut.exists() and foreign.exists()
    assert again.ignored == {"its parent segment is missing": 1, "unreadable": 1,
                             "an older format of this cache": 1,
                             "not a segment of this cache": 1}


def test_a_failed_write_leaves_no_tmp_and_the_writer_lives_on(tmp_path, monkeypatch):
    """A write that fails (any error, not only OSError) removes its half-written file, is
    counted in write_errors (not writes), and the background writer keeps serving: an
    exception that killed it would make flush() wait forever."""
    import engine.kv.disk_cache as dcm
    real = dcm.write_file
    fail = {"n": 2}

    def flaky(path, *a, **k):
        if fail["n"]:
            fail["n"] -= 1
            path.write_bytes(b"half")
            raise (RuntimeError("boom") if fail["n"] else OSError(errno.EIO, "I/O error"))
        return real(path, *a, **k)
    monkeypatch.setattr(dcm, "write_file", flaky)
    dc = DiskCache(tmp_path, 1 << 30, model="m")        # (a background writer)
    dc.store("base", ONE, _kv(100, 1.0))
    dc.store("base", TWO, _kv(100, 2.0))
    _within(10, dc.flush)
    assert dc.write_errors == 2 and dc.writes == 0 and list(tmp_path.glob("*.tmp")) == []
    dc.store("base", ONE, _kv(100, 1.0))
    _within(10, dc.flush)
    assert dc.writes == 1 and len(files(tmp_path)) == 1


def test_a_full_disk_lowers_the_cap_to_what_it_holds(tmp_path, monkeypatch):
    import engine.kv.disk_cache as dcm
    real = dcm.write_file
    dc = _cache(tmp_path)
    dc.store("base", ONE, _kv(100, 1.0))
    held = dc.bytes

    def full(path, *a, **k):
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(dcm, "write_file", full)
    dc.store("base", TWO, _kv(100, 2.0))
    assert dc.max_bytes == int(held * 0.9) and dc.write_errors == 1
    assert len(dc) == 0 and files(tmp_path) == [] and list(tmp_path.glob("*.tmp")) == []
    monkeypatch.setattr(dcm, "write_file", real)


def test_a_file_larger_than_the_cap_is_not_written(tmp_path):
    """It would be evicted as soon as written (every turn a write and a delete)."""
    dc = _cache(tmp_path, max_bytes=10_000)
    assert dc.store("base", ONE, _kv(100, 1.0)) == 0
    assert files(tmp_path) == [] and dc.writes == 0 and len(dc.refused) == 1


def test_a_second_process_on_the_directory_gets_a_clear_error(tmp_path, hold_dir):
    """Two servers on one directory deleted each other's files as corrupted and each kept
    its own cap; now the second is refused (the same process may open it again)."""
    from engine.kv.disk_dir import DirectoryInUse
    d = tmp_path / "shared"
    holder = hold_dir(d)
    with pytest.raises(DirectoryInUse, match=f"pid {holder.pid}"):
        _cache(d)
    holder.kill()
    holder.wait()
    dc = _cache(d)
    assert _cache(d).max_bytes == dc.max_bytes      # (again in this process: allowed)
