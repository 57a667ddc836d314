"""Per-process store of Responses-API turns for `previous_response_id`.

An entry is what a later request needs to resume: the conversation input
items, the output items and the instructions. Size = len(JSON(input)) +
len(JSON(output)) bytes; entries expire after `ttl` seconds (oldest first)
and the least recently used are evicted past `max_bytes` (the newest entry
is never evicted for its own sake: an entry larger than the cap alone is
not stored).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Optional

DEFAULT_TTL = 3600.0
DEFAULT_MAX_BYTES = 32 * 1024 * 1024


class ResponseStore:
    def __init__(self, ttl: float = DEFAULT_TTL, max_bytes: int = DEFAULT_MAX_BYTES,
                 clock=time.monotonic):
        self.ttl = float(ttl)
        self.max_bytes = int(max_bytes)
        self._clock = clock
        self._entries: "OrderedDict[str, tuple]" = OrderedDict()  # id -> (t, size, entry)
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0
        self.expired = 0

    def _expire(self) -> None:
        now = self._clock()
        # oldest-first by insertion time (the dict is in LRU order; scan all)
        dead = [k for k, (t, _, _) in self._entries.items() if now - t > self.ttl]
        for k in dead:
            self._bytes -= self._entries.pop(k)[1]
            self.expired += 1

    def put(self, rid: str, input_items: list, output_items: list,
            instructions: Optional[str], response: Optional[dict] = None) -> bool:
        """Store a turn (for previous_response_id) and, when given, the final response
        object (for GET /v1/responses/{id}); the byte cap counts both."""
        size = len(json.dumps(input_items, ensure_ascii=False)) + len(
            json.dumps(output_items, ensure_ascii=False)) + (
            len(json.dumps(response, ensure_ascii=False)) if response is not None else 0)
        if size > self.max_bytes:
            return False
        with self._lock:
            self._expire()
            if rid in self._entries:
                self._bytes -= self._entries.pop(rid)[1]
            self._entries[rid] = (self._clock(), size, {
                "input": input_items, "output": output_items, "instructions": instructions,
                "response": response})
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, (_, sz, _) = self._entries.popitem(last=False)
                self._bytes -= sz
                self.evictions += 1
        return True

    def get(self, rid: str) -> Optional[dict]:
        with self._lock:
            self._expire()
            item = self._entries.get(rid)
            if item is None:
                return None
            self._entries.move_to_end(rid)
            return item[2]

    def delete(self, rid: str) -> bool:
        with self._lock:
            self._expire()
            item = self._entries.pop(rid, None)
            if item is None:
                return False
            self._bytes -= item[1]
            return True

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            self._expire()
            return {"entries": len(self._entries), "bytes": self._bytes,
                    "max_bytes": self.max_bytes, "ttl_ms": int(self.ttl * 1000)}
