"""`engine-serve --tensor-parallel` on ranks > 0: replay rank 0's steps (server/tp.py has the
protocol and rank 0's side).

`follow(config, timeout)` loads this rank's shard, builds the same Engine as rank 0 and
runs a `Follower` on its worker thread: each message broadcast by rank 0 is checked
against this rank's last step (the token ids must agree, else `OutOfStep`), then its
submits and aborts are made on this rank's Engine, and a "step" steps it. "stop" ends
with status 0; a failure, or no message within the timeout, with EXIT_RANK_LOST.
"""

from __future__ import annotations

import os
import sys
import time

from .tp import EXIT_RANK_LOST, Message, Watchdog, agree_config, digest, params_from_json


class OutOfStep(RuntimeError):
    """This rank's step produced other tokens than rank 0's."""


class Follower:
    """A rank > 0: replays rank 0's messages on its own Engine."""

    def __init__(self, state, timeout: float, group=None):
        from engine.sharding import group_or_world
        self.engine = state.engine
        self.group = group_or_world(group)
        self.exit = os._exit            # (the thread waiting on rank 0 never returns)
        self.dog = Watchdog(timeout, self._stuck, "tp-watchdog")

    def _stuck(self, reason: str) -> None:
        print(f"engine-serve: tensor parallel rank {self.group.rank()}: rank 0 lost: {reason}; "
              f"exiting with status {EXIT_RANK_LOST}", file=sys.stderr, flush=True)
        self.exit(EXIT_RANK_LOST)

    def run(self) -> int:
        """Replay rank 0's calls until "stop" (0) or a failure (EXIT_RANK_LOST). Runs on
        the thread that owns this rank's Engine."""
        from engine.sharding import broadcast_json
        mine: list = []
        rank = self.group.rank()
        try:
            while True:
                with self.dog.busy("waiting for rank 0"):
                    msg = Message.from_json(broadcast_json(None, self.group))
                    if msg.check != mine:
                        raise OutOfStep(f"rank 0's step gave {msg.check}, this rank's {mine}")
                    if msg.kind == "stop":
                        return 0
                    for op in msg.ops:
                        if op.kind == "submit":
                            self.engine.submit(op.ids, params_from_json(op.params),
                                               request_id=op.rid)
                        else:
                            self.engine.abort(op.rid)
                    if msg.kind == "step":
                        mine = digest(self.engine.step())
        except Exception as e:
            print(f"engine-serve: tensor parallel rank {rank}: {type(e).__name__}: {e}; "
                  f"exiting with status {EXIT_RANK_LOST}", file=sys.stderr, flush=True)
            return EXIT_RANK_LOST
        finally:
            self.dog.stop()


def follow(config, timeout: float) -> int:
    """A rank > 0: load the shard, build the same engine, replay rank 0's steps."""
    from .state import build_state

    from engine.kv_quant import KVConfigError
    from engine.loader import ModelLoadError

    if config.memory_budget_bytes is not None:     # (as on rank 0: --memory-budget caps
        import mlx.core as mx                      # the allocator too)
        mx.set_memory_limit(int(config.memory_budget_bytes))
    config = agree_config(config)
    try:
        state = build_state(config)
    except (ModelLoadError, FileNotFoundError, KVConfigError, ValueError) as e:
        msg = getattr(e, "message", None) or str(e)
        print(f"engine-serve: cannot start: {msg}", file=sys.stderr)
        return 2
    try:
        return state.gateway.call_sync(lambda: Follower(state, timeout).run())
    finally:
        state.gateway.close()
        time.sleep(0.2)
