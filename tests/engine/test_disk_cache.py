"""The prompt cache on disk (`engine.kv.disk_cache`): a prefix written by one Engine is
restored by a new one (a restart) with logits bit-identical to a cold prefill; mlx-lm
reads the files; corrupted, truncated, other-model, other-KV-type and other-adapter files
are never used (one log line each); wrapped sliding windows are refused, not reused."""

import logging
import random
from pathlib import Path

import mlx.core as mx
import pytest

from engine import Engine, SamplingParams
from engine.kv.disk_cache import SUFFIX
from parity.fixtures.models import ensure_fixture

rnd = random.Random(0)
PREFIX = [rnd.randrange(10, 1000) for _ in range(150)]
MORE = [rnd.randrange(10, 1000) for _ in range(20)]


def _load(path, d, **kw):
    return Engine.load(path, keep_logprob_arrays=True,
                       **({"prompt_cache_dir": d} if d is not None else {}), **kw)


def _one(eng, prompt, max_tokens=4, **kw):
    eng.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), **kw)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    if eng.disk_cache is not None:
        eng.disk_cache.flush()
    ids = [t for o in outs for t in o.token_ids]
    arrays = [a for o in outs for a in o.logprob_arrays]
    return ids, arrays, outs[-1]


def _same(a, b):
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        mx.array_equal(x, y).item() for x, y in zip(a[1], b[1]))


@pytest.fixture(scope="module")
def qwen_path():
    return str(ensure_fixture("qwen3"))


@pytest.fixture(scope="module")
def cold(qwen_path):
    eng = _load(qwen_path, None)
    return {"prefix": _one(eng, PREFIX), "more": _one(eng, PREFIX + MORE)}


def files(d):
    return sorted(p for p in d.iterdir() if p.name.endswith(SUFFIX))


def test_restart_restores_the_prefix_bit_identical(tmp_path, qwen_path, cold):
    first = _load(qwen_path, tmp_path)
    assert _same(_one(first, PREFIX), cold["prefix"])
    st = first.disk_cache.stats()
    assert st["writes"] == 1 and st["bytes_written"] > 0 and len(files(tmp_path)) == 1
    again = _load(qwen_path, tmp_path)            # a restart: nothing in RAM
    assert len(again.disk_cache) == 1
    got = _one(again, PREFIX + MORE)
    assert got[2].cached_tokens >= len(PREFIX)
    assert again.disk_cache.stats()["hits"] == 1
    assert _same(got, cold["more"])               # logits equal a cold prefill's, bit for bit


@pytest.mark.parametrize("kw", [{"max_batch": 4}, {"kv_bits": 8, "kv_group_size": 32}],
                         ids=["batch-lane", "kv8"])
def test_restart_restores_bit_identical_batch_lane_and_quantized_kv(tmp_path, qwen_path, kw):
    """Batch lane: equal to a cold prefill. Quantized KV: equal to a hit in RAM (a cold
    prefill attends to its prompt's K/V before they are quantized, a reused prefix's were
    quantized already: mlx-lm's quantized prompt cache differs from its cold run alike)."""
    if "kv_bits" in kw:
        ram = _load(qwen_path, None, prompt_cache_bytes=1 << 30, **kw)
        _one(ram, PREFIX)
        want = _one(ram, PREFIX + MORE)
        assert want[2].cached_tokens >= len(PREFIX)
    else:
        want = _one(_load(qwen_path, None, **kw), PREFIX + MORE)
    _one(_load(qwen_path, tmp_path, **kw), PREFIX)
    again = _load(qwen_path, tmp_path, **kw)
    got = _one(again, PREFIX + MORE)
    assert got[2].cached_tokens >= len(PREFIX) and again.disk_cache.hits == 1
    assert _same(got, want)


def test_mlx_lm_reads_our_file_and_continues_alike(tmp_path, qwen_path):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache, trim_prompt_cache
    from parity.oracles import mlx_lm_oracle as oracle

    eng = _load(qwen_path, tmp_path)
    _one(eng, PREFIX)
    (f,) = files(tmp_path)
    theirs, meta = load_prompt_cache(str(f), return_metadata=True)
    assert meta["format"].startswith("mlx-parity") and meta["checksum"]
    restored, n = eng.disk_cache.restore("base", PREFIX + MORE)
    assert n == len(PREFIX) and theirs[0].offset == n + 4     # (the prompt + its answer)
    for a, b in zip(restored, theirs):
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
    trim_prompt_cache(theirs, 4)
    rmodel, _ = oracle.load(qwen_path)
    ref = [lp for _, lp in generate_step(mx.array((PREFIX + MORE)[n:]), rmodel, max_tokens=3,
                                          prompt_cache=theirs)]
    mine = _one(_load(qwen_path, tmp_path), PREFIX + MORE, max_tokens=3)[1]
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, mine))


def test_each_turn_writes_only_its_new_tokens(tmp_path, qwen_path):
    eng = _load(qwen_path, tmp_path)
    ids, _, _ = _one(eng, PREFIX)
    first = eng.disk_cache.last_write_bytes
    turn2 = PREFIX + ids + MORE
    _, _, out = _one(eng, turn2)
    second = eng.disk_cache.last_write_bytes
    assert out.cached_tokens > 0 and eng.disk_cache.writes == 2
    assert second < first / 3          # ~24 new tokens, not the 150-token prefix again
    _one(eng, PREFIX)                   # nothing new: no file
    assert eng.disk_cache.writes == 2
    # the second file continues the first: after a restart the whole turn 2 comes back
    again = _load(qwen_path, tmp_path)
    _, _, out = _one(again, turn2 + [7, 8, 9])
    assert out.cached_tokens >= len(turn2) and again.disk_cache.hits == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_file_is_ignored(tmp_path, qwen_path, cold, caplog, damage):
    _one(_load(qwen_path, tmp_path), PREFIX)
    (f,) = files(tmp_path)
    raw = bytearray(f.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x01                # one bit of K/V
        f.write_bytes(bytes(raw))
    else:
        f.write_bytes(bytes(raw[:len(raw) // 2]))
    again = _load(qwen_path, tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.kv.prompt_cache"):
        got = _one(again, PREFIX + MORE)
    assert got[2].cached_tokens == 0 and _same(got, cold["more"])
    assert again.disk_cache.ignored == {"corrupted": 1}
    assert len([r for r in caplog.records if "corrupted" in r.getMessage()]) == 1


def test_metadata_altered_is_ignored(tmp_path, qwen_path, cold):
    """The token ids live in the header: changing one must not map K/V to other tokens."""
    _one(_load(qwen_path, tmp_path), PREFIX)
    (f,) = files(tmp_path)
    raw = f.read_bytes()
    t = PREFIX[2] + (1 if PREFIX[2] % 10 < 9 else -1)       # as many digits: same length
    a, b = str(PREFIX[:3])[1:-1].encode(), str([PREFIX[0], PREFIX[1], t])[1:-1].encode()
    assert raw.count(a) == 1
    f.write_bytes(raw.replace(a, b))
    again = _load(qwen_path, tmp_path)
    prompt = [PREFIX[0], PREFIX[1], t] + PREFIX[3:] + MORE
    got = _one(again, prompt)
    assert got[2].cached_tokens == 0 and again.disk_cache.ignored == {"corrupted": 1}


def test_another_model_or_kv_type_is_ignored(tmp_path, qwen_path, caplog):
    _one(_load(qwen_path, tmp_path), PREFIX)
    with caplog.at_level(logging.WARNING, logger="engine.kv.prompt_cache"):
        other = _load(str(ensure_fixture("qwen3", "bfloat16")), tmp_path)
        q8 = _load(qwen_path, tmp_path, kv_bits=8, kv_group_size=32)
    assert other.disk_cache.ignored == {"another model": 1} and len(other.disk_cache) == 0
    assert q8.disk_cache.ignored == {"another KV type": 1} and len(q8.disk_cache) == 0
    assert _one(other, PREFIX + MORE)[2].cached_tokens == 0
    assert _one(q8, PREFIX + MORE)[2].cached_tokens == 0
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("another model" in m for m in msgs) == 1
    assert sum("another KV type" in m for m in msgs) == 1
    assert len(files(tmp_path)) == 3        # their own files, beside the first (not deleted)


def test_another_adapter_set_is_not_reused(tmp_path, qwen_path):
    from tests.server.srv_helpers import make_adapter
    a = make_adapter(qwen_path, tmp_path / "a", seed=1)
    b = make_adapter(qwen_path, tmp_path / "b", seed=2)
    d = tmp_path / "cache"
    eng = _load(qwen_path, d)
    eng.adapters.mount("x", str(a))
    _one(eng, PREFIX, adapter=("x",))
    base = _load(qwen_path, d)               # restart: base model, then "x" from other files
    assert _one(base, PREFIX + MORE)[2].cached_tokens == 0
    base.adapters.mount("x", str(b))
    cold_b = _load(qwen_path, None)
    cold_b.adapters.mount("x", str(b))
    got = _one(base, PREFIX + MORE, adapter=("x",))
    assert got[2].cached_tokens == 0 and _same(got, _one(cold_b, PREFIX + MORE, adapter=("x",)))
    same = _load(qwen_path, d)               # the same adapter files: restored
    same.adapters.mount("x", str(a))
    assert _one(same, PREFIX + MORE, adapter=("x",))[2].cached_tokens >= len(PREFIX)


def test_lru_eviction_under_the_byte_cap(tmp_path, qwen_path):
    eng = _load(qwen_path, tmp_path)
    _one(eng, PREFIX)
    size = eng.disk_cache.bytes
    small = _load(qwen_path, tmp_path, prompt_cache_disk_gb=2.5 * size / 1e9)
    for i in range(4):
        _one(small, [11 + i] + PREFIX)
    dc = small.disk_cache
    assert dc.bytes <= dc.max_bytes and len(dc) == 2 and dc.evictions == 3
    assert sum(p.stat().st_size for p in files(tmp_path)) == dc.bytes


@pytest.mark.parametrize("family", ["gemma3_text", "gemma4_text"])
def test_sliding_window_wrapped_is_refused_unwrapped_restores(tmp_path, caplog, family):
    """The fixtures' rings hold 16 tokens (gemma4_text also shares KV between layers): a
    longer sequence has lost its prefix's K/V and is not written (counted, logged once); a
    shorter one restores bit-identical."""
    path = str(ensure_fixture(family))
    eng = _load(path, tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.kv.prompt_cache"):
        _one(eng, PREFIX)
        _one(eng, MORE + PREFIX)
    assert eng.disk_cache.writes == 0 and not files(tmp_path)
    assert sum(eng.disk_cache.refused.values()) >= 2
    assert sum("wrapped" in r.getMessage() for r in caplog.records) == 1
    eng.disk_cache.min_tokens = 4
    short, longer = PREFIX[:8], PREFIX[:8] + [5, 6]
    _one(eng, short, max_tokens=2)
    again = _load(path, tmp_path)
    again.disk_cache.min_tokens = 4
    got = _one(again, longer, max_tokens=8)
    assert got[2].cached_tokens >= 8
    assert _same(got, _one(_load(path, None), longer, max_tokens=8))


def test_an_mlx_lm_file_in_the_directory_is_ignored_not_broken(tmp_path, qwen_path, caplog):
    """mlx_lm.cache_prompt's files carry no token ids: the directory cache cannot match
    prompts against them (engine-generate --prompt-cache-file reads them); they are
    skipped with one log line and left alone."""
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache
    from parity.oracles import mlx_lm_oracle as oracle
    rmodel, _ = oracle.load(qwen_path)
    theirs = make_prompt_cache(rmodel)
    rmodel(mx.array([PREFIX]), cache=theirs)
    save_prompt_cache(str(tmp_path / "theirs.safetensors"), theirs, {"model": "x"})
    with caplog.at_level(logging.WARNING, logger="engine.kv.prompt_cache"):
        eng = _load(qwen_path, tmp_path)
    assert eng.disk_cache.ignored == {"not a segment of this cache": 1} and len(eng.disk_cache) == 0
    assert sum("theirs.safetensors" in r.getMessage() for r in caplog.records) == 1
    assert _one(eng, PREFIX + MORE)[2].cached_tokens == 0
    assert (tmp_path / "theirs.safetensors").exists()


def _kv(n: int, tag: float):
    from engine.kv.cache import KVCache
    c = KVCache()
    c.keys = c.values = mx.full((1, 1, n, 64), tag)
    c.offset = n
    return [c]


def test_eviction_takes_leaves_and_keeps_a_shared_prefix(tmp_path):
    """A root prefix continued by two conversations: over the cap, the older conversation's
    file goes, never the prefix the newer one needs (deleting it would orphan that one)."""
    from engine import DiskCache
    root = list(range(100, 400))
    dc = DiskCache(tmp_path, 1 << 30, model="m", background=False)
    dc.store("base", root, _kv(300, 1.0))
    dc.store("base", root + [1] * 100, _kv(400, 2.0))
    dc.store("base", root + [2] * 100, _kv(400, 3.0))
    assert len(dc) == 3 and dc.writes == 3
    one = dc.last_write_bytes
    again = DiskCache(tmp_path, dc.bytes - one // 2, model="m", background=False)  # restart
    assert len(again) == 2 and again.evictions == 1
    caches, n = again.restore("base", root + [2] * 100 + [5])
    assert n == 400 and mx.array_equal(caches[0].keys[..., 300:, :], mx.full((1, 1, 100, 64), 3.0))
    assert again.restore("base", root + [1] * 100 + [5])[1] == 300    # the prefix alone
    # a deep chain (one file per turn) is indexed without recursion
    deep = DiskCache(tmp_path / "deep", 1 << 30, model="m", background=False)
    seq = []
    for turn in range(1200):
        seq = seq + [turn % 50 + 10] * 2
        if len(seq) >= 64:
            deep.store("base", seq, _kv(len(seq), 0.0))
    assert len(DiskCache(tmp_path / "deep", 1 << 30, model="m")) == len(deep)


def test_files_hold_exactly_the_arrays_contiguous_or_not(tmp_path):
    """`host_buffers` views contiguous arrays as they are and copies the others out (a
    transposed bf16 array's memoryview is not contiguous): mx.load gets the same values."""
    from engine.kv.cache_file import CHECKSUM, host_buffers, write_file
    arrays = {"a": mx.arange(12, dtype=mx.float32).reshape(3, 4).T,
              "b": (mx.arange(24).reshape(2, 3, 4) / 7).astype(mx.bfloat16).transpose(2, 0, 1),
              "c": mx.array([], dtype=mx.float32), "d": mx.array(5)}
    mx.eval(list(arrays.values()))
    p = tmp_path / "x.safetensors"
    write_file(p, host_buffers(arrays), {"k": "v"})
    back, meta = mx.load(str(p), return_metadata=True)
    assert meta["k"] == "v" and len(meta[CHECKSUM]) == 8
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and mx.array_equal(back[k], a).item(), k


def test_a_valid_file_swapped_after_the_scan_is_not_used(tmp_path):
    """Checksums hold, but the file under a name now holds another sequence (replaced
    after the index was read): its tokens are checked against the prompt's."""
    from engine import DiskCache
    one, two = list(range(100, 200)), list(range(300, 400))
    dc = DiskCache(tmp_path, 1 << 30, model="m", background=False)
    dc.store("base", one, _kv(100, 1.0))
    f1 = files(tmp_path)[0]
    dc.store("base", two, _kv(100, 2.0))
    (f2,) = [p for p in files(tmp_path) if p != f1]
    again = DiskCache(tmp_path, 1 << 30, model="m", background=False)
    f1.write_bytes(f2.read_bytes())
    assert again.restore("base", one + [1]) is None
    assert again.ignored == {"corrupted": 1}
    assert again.restore("base", two + [1])[1] == 100


def test_a_failing_cache_never_fails_the_request(tmp_path, qwen_path, cold, monkeypatch):
    """Whatever breaks inside the disk cache (here: every array op it makes), the
    request runs cold and answers as without it."""
    import engine.kv.disk_cache as dcm
    eng = _load(qwen_path, tmp_path)
    _one(eng, PREFIX)

    def boom(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(dcm, "_cat", boom)
    monkeypatch.setattr(dcm, "_cut", boom)
    again = _load(qwen_path, tmp_path)
    got = _one(again, PREFIX + MORE)
    assert got[2].cached_tokens == 0 and _same(got, cold["more"])
    assert again.disk_cache.misses == 1 and list(again.disk_cache.refused) == ["error (RuntimeError: boom)"]


@pytest.mark.parametrize("alter", ["shape", "offsets", "past_the_end"])
def test_an_altered_array_entry_is_ignored_and_leaves_nothing_mapped(tmp_path, alter):
    """An array entry (dtype, shape, offsets) that no longer fits its bytes is caught as a
    corrupted file (deleted, the request cold) before any array is read, not an error from
    inside the read (the checksum covers the entries since format 2, but runs beside the
    copies); and a restore, good or bad, leaves no mapping of a file behind (files are
    mapped while read: 0.6.2)."""
    import json
    import struct
    from engine import DiskCache
    one, two = list(range(100, 200)), list(range(300, 400))
    dc = DiskCache(tmp_path, 1 << 30, model="m", background=False)
    dc.store("base", one, _kv(100, 1.0))
    bad = files(tmp_path)[0]
    dc.store("base", two, _kv(100, 2.0))
    raw = bad.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    entry = header[key]
    a, b = entry["data_offsets"]
    if alter == "shape":
        entry["shape"] = entry["shape"][:-1] + [entry["shape"][-1] - 1]
    elif alter == "offsets":
        entry["data_offsets"] = [a, b - 6]
    else:
        entry["data_offsets"] = [a, len(raw) + b]
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    bad.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])
    again = DiskCache(tmp_path, 1 << 30, model="m", background=False)
    assert again.restore("base", one + [1]) is None
    assert again.ignored == {"corrupted": 1} and not bad.exists()
    caches, n_tokens = again.restore("base", two + [1])
    assert n_tokens == 100 and mx.array_equal(caches[0].keys, mx.full((1, 1, 100, 64), 2.0)).item()
    maps = Path("/proc/self/maps")
    if maps.exists():       # (Linux: CI's machines)
        assert str(tmp_path) not in maps.read_text()


def test_a_file_left_half_written_by_a_dead_process_is_deleted_at_start(tmp_path, caplog):
    """A killed server leaves `<name>.<pid>.tmp`: the next start deletes it (one log line),
    unless its process still runs (another server on the directory, writing it now)."""
    import os
    import subprocess
    import sys
    from engine import DiskCache
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dead = tmp_path / f"{'a' * 40}.{gone}.tmp"
    live = tmp_path / f"{'b' * 40}.{os.getpid()}.tmp"
    old = tmp_path / f"{'c' * 40}.tmp"          # (the name before 0.6.2: no pid)
    for f in (dead, live, old):
        f.write_bytes(b"\0" * 100)
    with caplog.at_level(logging.WARNING, logger="engine.kv.prompt_cache"):
        dc = DiskCache(tmp_path, 1 << 30, model="m", background=False)
    assert not dead.exists() and not old.exists() and live.exists()
    assert dc.ignored == {"an unfinished write": 2} and len(dc) == 0
    assert len([r for r in caplog.records if "unfinished" in r.getMessage()]) == 2


def test_longest_chain_and_its_rehearsal(tmp_path):
    """`longest_chain`: the longest stored prefix's token count and its files, root first (what
    a restart's first turn restores); the warm-up's `rehearse_files` reads them through the
    same checks and counts their bytes, leaves the cache as it was, and stops at a file that
    fails (the restore that meets it logs and deletes it)."""
    from engine import DiskCache
    from engine.step.warmup import rehearse_files, warm_up
    assert DiskCache(tmp_path / "none", 1 << 30, model="m").longest_chain() == (0, [])
    root = list(range(100, 400))
    dc = DiskCache(tmp_path, 1 << 30, model="m", background=False)
    dc.store("base", root, _kv(300, 1.0))
    dc.store("base", root + [1] * 100, _kv(400, 2.0))
    dc.store("base", list(range(500, 650)), _kv(150, 3.0))
    again = DiskCache(tmp_path, 1 << 30, model="m", background=False)        # (a restart)
    n, paths = again.longest_chain()
    assert n == 400 and len(paths) == 2
    sizes = [p.stat().st_size for p in paths]
    assert sizes[0] > sizes[1]                     # (the root: 300 tokens, then its 100)
    assert rehearse_files(paths) == sum(sizes)
    assert (again.hits, again.misses, len(again)) == (0, 0, 3)
    paths[1].write_bytes(paths[1].read_bytes()[:-10])             # (cut short)
    assert rehearse_files(paths) == sizes[0]
    assert rehearse_files(paths[::-1]) == 0

    class NoEngine:                  # (the warm-up with nothing but the rehearsal to run)
        fast_step = draft_step = None
        draft_rows = lookup_rows = False
        max_batch = 4
    assert warm_up(NoEngine(), l1=False, rehearse=paths).rehearsed_bytes == 0   # (CPU: off)


def test_timings_split_the_first_token_and_hold_the_restore(tmp_path, qwen_path):
    """`RequestOutput.timings`: waiting, lookup and prefill, none before the first token; after a
    restart the disk restore is inside `lookup_s` (at least the cache's own `last_restore_ms`)
    and the prefill is only the suffix's."""
    d = tmp_path / "pc"
    eng = _load(qwen_path, d)
    eng.submit(PREFIX, SamplingParams(max_tokens=3, temperature=0.0))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    eng.disk_cache.flush()
    t = outs[-1].timings
    assert set(t) == {"waiting_s", "lookup_s", "prefill_s"} and min(t.values()) >= 0
    assert all(o.timings is not None for o in outs if o.token_ids)
    again = _load(qwen_path, d)                                  # (a restart)
    *_, last = _one(again, PREFIX + MORE)
    assert last.cached_tokens > 100 and again.disk_cache.hits == 1
    t2 = last.timings
    assert t2["lookup_s"] * 1e3 >= again.disk_cache.last_restore_ms > 0


@pytest.mark.parametrize("tokens", [[-1, 5, 6], [10 ** 20, 5], [None, 1], ["a", "b"],
                                    [True, 3], [1.5], {"a": 1}, "12"])
def test_a_file_whose_token_ids_are_not_ids_is_ignored_at_the_scan(tmp_path, qwen_path, tokens):
    """(A hostile probe's finding: such a file made a restarted server's warm-up fail to
    start, decoding its ids.) The scan ignores it (deleted, counted), nothing is restored,
    and a server starts on the directory."""
    import json
    import struct
    from engine.kv.disk_cache import DiskCache
    from server.state import ServerConfig, build_state

    def written_and_tampered() -> dict:
        _one(_load(qwen_path, tmp_path), PREFIX)
        (f,) = files(tmp_path)
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        header["__metadata__"]["0.tokens"] = json.dumps(tokens)
        head = json.dumps(header).encode()
        f.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])
        return header["__metadata__"]
    meta = written_and_tampered()
    disk = DiskCache(tmp_path, 10 ** 9, model=meta["0.model"], kv=meta["0.kv"], background=False)
    assert len(disk) == 0 and disk.ignored == {"unreadable": 1} and files(tmp_path) == []
    assert disk.longest_ids() == []
    written_and_tampered()
    state = build_state(ServerConfig(model=qwen_path, prompt_cache_dir=str(tmp_path)))
    assert state.remembered == 0 and state.engine.disk_cache.ignored == {"unreadable": 1}
    state.gateway.close()
