"""Rank 0 of a tensor-parallel Engine: every call it makes, made on every rank.

`Leader` wraps rank 0's `Engine` and has its interface (`submit`, `abort`, `step`,
`has_unfinished`, and every other attribute read through). It records each `submit`
(the prompt's token ids and `SamplingParams`) and `abort`, and before every `step()`
broadcasts them with the word "step"; the other ranks (`follower.Follower`) make the
same calls on their own Engine and step it, so every rank runs the same forward on its
shard and the all-reduces inside the sharded layers line up.

Tokens agree because every rank samples the same full logits with the same key: a
sampling request without a seed gets one drawn here and sent with it.

A lost rank: a collective fails (the ring reports the closed connection, in the
broadcast or inside the forward, where the engine ends the requests with that error),
hands back a partial sum, or blocks. A watchdog times every step and broadcast. A
failure found by a step raises `RankLost` (a subclass may answer otherwise: the server
answers 503); a step stuck past `timeout` seconds can never return, so the process
exits with EXIT_RANK_LOST. A step that ends a request is confirmed by a heartbeat first
(a partial sum can pick a stop token).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
from typing import Optional

from . import sharding
from .protocol import (DEFAULT_TIMEOUT_S, EXIT_RANK_LOST, SEED_BITS, SHUTDOWN_GRACE_S,
                       Message, Op, RankLost, collective_failure, describe, digest,
                       params_to_json)
from .watchdog import Watchdog


class Leader:
    """Rank 0's Engine under tensor parallelism. Use it from the thread that owns the
    Engine (but `fail`, `on_shutdown_signal`: any thread). `close()` (or leaving a
    `with` block) tells the other ranks to stop."""

    rank_lost = RankLost        # what a submit (or step) after a loss raises
    raise_on_loss = True        # a step that finds a lost rank raises (False: returns [])
    loss_note = ""              # the end of the line printed on a loss

    def __init__(self, engine, timeout: Optional[float] = DEFAULT_TIMEOUT_S, group=None, *,
                 name: str = "engine"):
        self.engine = engine
        self.group = sharding.group_or_world(group)
        self.name = name
        self.dead = threading.Event()
        self.lost: Optional[str] = None  # why the ranks were given up
        self.exit = os._exit            # (not sys.exit: the caller may be stuck in MLX)
        self.stopped = False
        self.stopping = False           # a stop signal came (on_shutdown_signal)
        self.shutdown_grace = SHUTDOWN_GRACE_S
        self._ops: list = []
        self._check: list = []
        self._fail_lock = threading.Lock()
        self._exited = False
        self.dog = Watchdog(timeout, self.hung, "tp-watchdog")

    def __getattr__(self, name):       # tokenizer, stats(), batching, policy, ...
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the Engine's calls -----------------------------------------------------------

    def submit(self, prompt, params=None, *, request_id=None, adapter=(), **kw):
        from ..request import SamplingParams, encode_prompt

        if self.dead.is_set():
            raise self.rank_lost("a rank was lost earlier")
        if self.stopped:
            raise RuntimeError("this tensor-parallel engine is closed")
        params = params or SamplingParams()
        if params.processor_factories:
            raise ValueError("structured outputs and enforced tool_choice are not available "
                             "on a tensor-parallel engine")
        if adapter or kw:
            raise ValueError("adapters, tools and template options are not available "
                             "through a tensor-parallel engine (send token ids)")
        if params.seed is None and (params.resolved(self.engine.tokenizer).temperature or 0) > 0:
            params = dataclasses.replace(params, seed=secrets.randbits(SEED_BITS))
        ids = encode_prompt(self.engine.tokenizer, prompt)
        rid = self.engine.submit(ids, params, request_id=request_id)
        self._ops.append(Op("submit", rid, ids, params_to_json(params)))
        return rid

    def abort(self, request_id) -> bool:
        self._ops.append(Op("abort", str(request_id)))
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return not self.dead.is_set() and not self.stopped and self.engine.has_unfinished()

    def step(self) -> list:
        if self.dead.is_set():
            return self._gone(self.lost)
        if self.stopped:
            return []
        try:
            with self.dog.busy("step"):
                self._send("step")
                outs = self.engine.step()
                self._check = digest(outs)
                lost = self._lost_in(outs)
        except Exception as e:          # the ring lost a peer (RuntimeError), or a bug:
            # either way the ranks can no longer be kept in step
            return self._gone(describe(e))
        if lost is not None:
            return self._gone(lost)
        return outs

    # --- messages -----------------------------------------------------------------------

    def _send(self, kind: str) -> None:
        msg, self._ops = Message(kind, self._ops, self._check), []
        sharding.broadcast_json(dataclasses.asdict(msg), self.group)

    def _lost_in(self, outs) -> Optional[str]:
        """Whether a step's outputs mean a lost rank (the reason) or not (None). A fault
        in the forward ends requests with an error: a lost rank when it came from a
        collective, when a heartbeat then fails, or after a stop signal (under
        mlx.launch: a rank exited). A step that ends a request is confirmed by a
        heartbeat too: a ring that lost a peer may return partial sums, whose logits
        can pick a stop token (not to reach the caller as a finished answer)."""
        from ..request import client_error
        failed = [o for o in outs if o.finish_reason == "error" and not client_error(o)]
        for o in failed:
            if collective_failure(o.error):
                return describe(o.error)
        if failed or any(o.finished for o in outs):
            self._send("ping")          # raises (or blocks until the watchdog): lost
        if failed and self.stopping:
            return f"a step failed after the stop signal: {describe(failed[0].error)}"
        return None

    def _message(self, kind: str) -> None:
        """A message with no step (timed like a step)."""
        if self.dead.is_set() or self.stopped:
            return
        try:
            with self.dog.busy(kind):
                self._send(kind)
        except Exception as e:          # (see step)
            self._gone(describe(e))

    def tick(self) -> None:
        """A heartbeat: call it when idle for a while if the followers wait with a timeout."""
        self._message("ping")

    def send_stop(self) -> None:
        """Tell the other ranks to stop (their loop ends with status 0)."""
        self._message("stop")
        self.stopped = True

    def close(self) -> None:
        """Tell the other ranks to stop (once) and stop the watchdog."""
        if not self.stopped and not self.dead.is_set():
            self.send_stop()
        self.dog.stop()

    # --- a lost rank ----------------------------------------------------------------------

    def _gone(self, reason: str) -> list:
        self.fail(reason)
        if self.raise_on_loss:
            raise self.rank_lost(self.lost)
        return []

    def on_shutdown_signal(self) -> None:
        """SIGTERM/SIGINT (under mlx.launch: most likely because a rank exited): a step
        that now fails or hangs past `shutdown_grace` seconds is a lost rank. Any thread."""
        self.stopping = True
        t = self.dog.timeout
        self.dog.timeout = self.shutdown_grace if t is None else min(t, self.shutdown_grace)

    def fail(self, reason: str) -> bool:
        """Give the other ranks up (once; True the first time). Any thread."""
        with self._fail_lock:
            if self.dead.is_set():
                return False
            self.lost = reason
            self.dead.set()
        self.dog.stop()
        print(f"{self.name}: tensor parallel: lost a rank: {reason}{self.loss_note}",
              file=sys.stderr, flush=True)
        return True

    def hung(self, reason: str) -> None:
        """The watchdog's call: the thread is stuck in a collective and never returns,
        so the process ends with EXIT_RANK_LOST."""
        self.fail(reason)
        self.exit_lost()

    def exit_lost(self) -> None:
        """Exit with EXIT_RANK_LOST, once."""
        with self._fail_lock:
            if self._exited:
                return
            self._exited = True
        sys.stderr.flush()
        self.exit(EXIT_RANK_LOST)
