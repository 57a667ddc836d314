"""The Responses store: TTL, byte cap, LRU order (fake clock, no server)."""

import json

from server.store import ResponseStore


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def size(inp, out):
    return len(json.dumps(inp)) + len(json.dumps(out))


def test_ttl_expiry():
    c = Clock()
    s = ResponseStore(ttl=10, clock=c)
    s.put("a", [{"x": 1}], [], None)
    c.t = 9.9
    assert s.get("a") is not None
    c.t = 10.1
    assert s.get("a") is None and s.stats()["entries"] == 0 and s.expired == 1


def test_byte_cap_evicts_least_recently_used():
    item = [{"t": "x" * 80}]
    one = size(item, item)
    s = ResponseStore(max_bytes=3 * one + 5)
    for k in "abc":
        s.put(k, item, item, "sys")
    assert s.stats()["bytes"] == 3 * one
    assert s.get("a")["instructions"] == "sys"     # touch: b is now the oldest
    s.put("d", item, item, None)
    assert s.get("b") is None and s.get("a") is not None and s.get("d") is not None
    assert s.evictions == 1 and s.stats()["bytes"] <= s.max_bytes


def test_oversized_entry_is_not_stored():
    s = ResponseStore(max_bytes=50)
    assert s.put("big", [{"t": "x" * 100}], [], None) is False
    assert s.get("big") is None and len(s) == 0


def test_stats_shape():
    st = ResponseStore().stats()
    assert st == {"entries": 0, "bytes": 0, "max_bytes": 33554432, "ttl_ms": 3600000}
