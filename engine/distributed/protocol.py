"""What rank 0 sends the other ranks before each step, and how a lost rank shows.

Rank 0 records every `submit` (the prompt's token ids and its `SamplingParams`) and
`abort` it makes on its Engine; before each `step()` it broadcasts them as one
`Message` (`sharding.broadcast_json`). Each message also carries `check`: the token
ids rank 0's previous step produced, so a rank that produced others can stop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

EXIT_RANK_LOST = 3          # the process status of a rank that gave the others up
DEFAULT_TIMEOUT_S = 60.0    # a step or heartbeat slower than this means a lost rank
SHUTDOWN_GRACE_S = 3.0      # after SIGTERM/SIGINT, a step stuck this long means a lost rank
SEED_BITS = 63

COLLECTIVE_ERRORS = ("[ring]", "[nccl]", "[mpi]", "[jaccl]", "a rank was lost")


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone (or out of step): the ranks cannot go on."""

    def __init__(self, reason: str):
        super().__init__(f"lost a tensor-parallel rank ({reason})")
        self.reason = reason


class OutOfStep(RuntimeError):
    """This rank's step produced other tokens than rank 0's."""


@dataclass
class Op:
    """One Engine call rank 0 made since the previous step: submit or abort."""
    kind: str                       # "submit" | "abort"
    rid: str
    ids: list = field(default_factory=list)
    params: dict = field(default_factory=dict)


@dataclass
class Message:
    """What every rank does next. `check`: rank 0's previous step, as
    [request id, token ids, finish reason] per output."""
    kind: str                       # "step" | "ping" | "stop"
    ops: list = field(default_factory=list)
    check: list = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict) -> "Message":
        return cls(d["kind"], [Op(**o) for o in d["ops"]], d["check"])


def params_to_json(p) -> dict:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
         if f.name != "processor_factories"}
    d["stop"] = list(p.stop)
    return d


def params_from_json(d: dict):
    from ..request import SamplingParams
    d = dict(d)
    if d.get("logit_bias"):
        d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
    return SamplingParams(**d)


def digest(outs) -> list:
    return [[o.request_id, list(o.token_ids), o.finish_reason] for o in outs]


def collective_failure(e: Optional[BaseException]) -> bool:
    """An error raised by a collective: MLX's distributed backends prefix theirs with
    the backend's name ("[ring] connection to a peer was lost"); `broadcast_json` says
    "a rank was lost" when a sum did not reach every rank."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in COLLECTIVE_ERRORS)


def describe(e: BaseException) -> str:
    return str(e) if type(e) is RuntimeError else f"{type(e).__name__}: {e}"
