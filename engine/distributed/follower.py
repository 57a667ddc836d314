"""Ranks > 0 of a tensor-parallel Engine: replay rank 0's calls (`leader.Leader`).

`Follower(engine).run()` takes each message rank 0 broadcasts, checks it against this
rank's last step (the token ids must agree, else `OutOfStep`), makes its submits and
aborts on this rank's Engine, and steps it on "step". "stop" ends the loop with status
0; a failure, or (with a timeout) no message within it, with EXIT_RANK_LOST.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from . import sharding
from .protocol import EXIT_RANK_LOST, Message, OutOfStep, digest, params_from_json
from .watchdog import Watchdog


class Follower:
    """A rank > 0: replays rank 0's messages on its own Engine. `timeout`: seconds to
    wait for rank 0's next message before giving it up (None: no limit; a rank 0 that
    exits closes its connections, which ends the wait with an error)."""

    def __init__(self, engine, timeout: Optional[float] = None, group=None, *,
                 name: str = "engine"):
        self.engine = engine
        self.group = sharding.group_or_world(group)
        self.name = name
        self.exit = os._exit            # (the thread waiting on rank 0 never returns)
        self.dog = Watchdog(timeout, self._stuck, "tp-watchdog")

    def _stuck(self, reason: str) -> None:
        print(f"{self.name}: tensor parallel rank {self.group.rank()}: rank 0 lost: {reason}; "
              f"exiting with status {EXIT_RANK_LOST}", file=sys.stderr, flush=True)
        self.exit(EXIT_RANK_LOST)

    def run(self) -> int:
        """Replay rank 0's calls until "stop" (0) or a failure (EXIT_RANK_LOST). Runs on
        the thread that owns this rank's Engine."""
        mine: list = []
        rank = self.group.rank()
        try:
            while True:
                with self.dog.busy("waiting for rank 0"):
                    msg = Message.from_json(sharding.broadcast_json(None, self.group))
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
            print(f"{self.name}: tensor parallel rank {rank}: {type(e).__name__}: {e}; "
                  f"exiting with status {EXIT_RANK_LOST}", file=sys.stderr, flush=True)
            return EXIT_RANK_LOST
        finally:
            self.dog.stop()
