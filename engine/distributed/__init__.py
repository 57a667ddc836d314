"""Distributed execution: a model sharded over the ranks of an `mx.distributed` launch
(`sharding`), and one Engine driven on every rank (`Leader` on rank 0, `Follower` on the
others). `Engine.load(path, tensor_parallel=True)` puts them together (`coordinate`);
docs/distributed.md has the user's view."""

from __future__ import annotations

import atexit

from .follower import Follower
from .leader import Leader
from .protocol import (DEFAULT_TIMEOUT_S, EXIT_RANK_LOST, SHUTDOWN_GRACE_S, Message, Op,
                       OutOfStep, RankLost, collective_failure, params_from_json,
                       params_to_json)
from .sharding import (ShardingError, ShardPlan, agreed_seed, barrier, broadcast_json,
                       group_or_world, shard_model)
from .watchdog import Watchdog

__all__ = ["DEFAULT_TIMEOUT_S", "EXIT_RANK_LOST", "SHUTDOWN_GRACE_S", "Follower", "Leader",
           "Message", "Op", "OutOfStep", "RankLost", "ShardPlan", "ShardingError", "Watchdog",
           "agreed_seed", "barrier", "broadcast_json", "collective_failure", "coordinate",
           "group_or_world", "params_from_json", "params_to_json", "shard_model"]


def coordinate(engine, timeout=DEFAULT_TIMEOUT_S, group=None):
    """Drive `engine` (built the same way on every rank, over a sharded model) from rank 0.

    Rank 0: returns a `Leader` over it (the Engine's interface; closed at exit, which
    tells the other ranks to stop). Ranks > 0: replay rank 0's calls until it closes,
    then end the process (`SystemExit`: status 0, or EXIT_RANK_LOST when rank 0 was lost
    or out of step), so a script's code after `Engine.load` runs on rank 0 only."""
    group = group_or_world(group)
    if group.rank() == 0:
        leader = Leader(engine, timeout, group)
        atexit.register(leader.close)
        return leader
    raise SystemExit(Follower(engine, None, group).run())
