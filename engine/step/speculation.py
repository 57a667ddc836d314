"""Counters of speculative decoding, per request and per engine, for both sources of drafts:
prompt lookup (`engine.step.lookup`, the request's own tokens) and a draft model
(`engine.step.draft`, a second, smaller model).

`SpecStats` counts one request's (or one source's) drafts; a request's counts also go to
its source's totals (`parent`). `Speculation` holds the engine's totals per source and the
counts of the last `RECENT` requests that speculated: `Engine.stats()["speculation"]`,
served as /stats `speculation` and /metrics `engine_spec_*_total{source=...}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SOURCES = ("lookup", "draft")
RECENT = 32          # finished requests kept in `Speculation.stats()["recent"]`


@dataclass
class SpecStats:
    drafted: int = 0     # draft tokens proposed and verified
    accepted: int = 0    # of them, accepted (handed out as they were drafted)
    forwards: int = 0    # verify forwards of the target (each hands out 1 + the accepted)
    parent: Optional["SpecStats"] = field(default=None, repr=False, compare=False)

    def record(self, drafted: int, accepted: int, forwards: int = 1) -> None:
        """A verify forward (`forwards`): `drafted` drafts checked, `accepted` of them kept."""
        s = self
        while s is not None:
            s.drafted += drafted
            s.accepted += accepted
            s.forwards += forwards
            s = s.parent

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "forwards": self.forwards,
                "acceptance": self.accepted / self.drafted if self.drafted else None}


class Speculation:
    """The engine's counters: totals per source, and the last requests that speculated."""

    def __init__(self):
        self.totals = {s: SpecStats() for s in SOURCES}
        self.recent: tuple = ()      # (copied on write: stats() may be read from another thread)

    def for_request(self, source: str) -> SpecStats:
        """A request's own counters, adding up into `source`'s totals."""
        return SpecStats(parent=self.totals[source])

    def finished(self, request_id: str, stats: SpecStats) -> None:
        """A request's counts (from `for_request`), kept among the recent ones."""
        source = next(s for s, t in self.totals.items() if t is stats.parent)
        entry = {"request_id": request_id, "source": source, **stats.as_dict()}
        self.recent = (self.recent + (entry,))[-RECENT:]

    def stats(self) -> dict:
        """Every source's counts summed (the top-level keys), each source's, and the last
        requests' (oldest first)."""
        total = SpecStats(drafted=sum(t.drafted for t in self.totals.values()),
                          accepted=sum(t.accepted for t in self.totals.values()),
                          forwards=sum(t.forwards for t in self.totals.values()))
        return {**total.as_dict(), **{s: t.as_dict() for s, t in self.totals.items()},
                "recent": list(self.recent)}
