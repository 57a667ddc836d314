"""A thread that times sections which may block forever (a collective with a lost peer)."""

from __future__ import annotations

import threading
import time
from typing import Optional


class Watchdog:
    """Calls `on_stuck(reason)` once, when a section entered with `busy()` lasts over
    `timeout` seconds (checked twice a second, or ten times per timeout if shorter).
    `timeout=None`: no limit (no thread)."""

    def __init__(self, timeout: Optional[float], on_stuck, name: str):
        self.timeout = timeout
        self.on_stuck = on_stuck
        self.since: Optional[float] = None
        self.what = ""
        self._stop = threading.Event()
        if timeout is not None:
            threading.Thread(target=self._run, name=name, daemon=True).start()

    def busy(self, what: str) -> "Section":
        return Section(self, what)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tick = min(0.5, self.timeout / 10)
        while not self._stop.wait(tick):
            since = self.since
            if since is not None and time.monotonic() - since > self.timeout:
                self._stop.set()
                self.on_stuck(f"no answer within {self.timeout:g} s ({self.what})")


class Section:
    def __init__(self, dog: Watchdog, what: str):
        self.dog, self.what = dog, what

    def __enter__(self):
        self.dog.what, self.dog.since = self.what, time.monotonic()

    def __exit__(self, *exc):
        self.dog.since = None
