"""`engine-serve --tensor-parallel`: one server over the ranks of an `mx.distributed` launch.

    mlx.launch -n 2 --backend ring -- engine-serve --tensor-parallel --model DIR ...

Every rank loads the model sharded and builds the same `engine.Engine` (same flags;
rank 0's memory budget). Rank 0 serves HTTP as usual; its worker thread drives the
engine through `Leader`, the engine's `engine.distributed.Leader` (every submit and
abort made on every rank, a heartbeat while idle) with the server's answer to a lost
rank. Ranks > 0 serve nothing: `follow()` runs `engine.distributed.Follower` on the
worker thread. The protocol and its guarantees are in engine/distributed/.

What is the server's here: a lost rank (a failed collective, a partial sum, or a step or
heartbeat past `--tp-timeout` seconds) answers every running and queued request, and
every new one, 503 in its protocol's shape, then rank 0 exits with status 3. After
SIGTERM/SIGINT (mlx.launch sends it when a rank exits) running requests may finish, but
a step that fails or hangs for SHUTDOWN_GRACE_S is a lost rank too.

Refused under tensor parallelism: adapters (`--adapter`, POST /v1/adapters: 400),
structured outputs and enforced tool choice (400: their grammar runs on rank 0 only),
and the L3 levers (`--tier`: a start-up error).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Optional

from engine import distributed
from engine import DEFAULT_TIMEOUT_S, EXIT_RANK_LOST, SHUTDOWN_GRACE_S

from .errors import APIError, body_for

__all__ = ["EXIT_RANK_LOST", "SHUTDOWN_GRACE_S", "DeadGuard", "Leader", "RankLost",
           "add_args", "agree_config", "follow", "lead", "refusal"]


def add_args(p) -> None:
    p.add_argument("--tensor-parallel", action="store_true",
                   help="shard the model over the ranks of an mlx.launch (rank 0 serves "
                        "HTTP; docs/distributed.md)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="with --tensor-parallel: a step or heartbeat that does not complete "
                        f"within S seconds means a rank is lost (default {DEFAULT_TIMEOUT_S:g}; "
                        "keep it above your slowest prefill step)")


def refusal(args, config) -> Optional[str]:
    """Why these flags cannot run under --tensor-parallel (None: they can)."""
    if not args.tp_timeout > 0:
        return "--tp-timeout must be > 0"
    if config.adapter:
        return "--adapter cannot be used with --tensor-parallel (adapters are not sharded)"
    lv = config.levers
    if lv is not None and any(getattr(lv, f.name) for f in dataclasses.fields(lv)
                              if f.type in (bool, "bool")):
        return f"--tier {lv.tier} / L3 levers cannot be used with --tensor-parallel"
    return None


class RankLost(APIError):
    """The answer when a tensor-parallel rank is gone: 503, the server is stopping."""

    def __init__(self, reason: str):
        super().__init__(503, f"the server lost a tensor-parallel rank ({reason}) and is "
                              "shutting down", type="overloaded_error")


def agree_config(config, group=None):
    """Every rank takes rank 0's engine-shaping settings (one command line launched on
    every rank should agree already; the memory budget defaults to each machine's RAM)."""
    from engine import default_budget

    keys = ("batch", "prompt_cache_bytes", "kv_quant", "kv_group_size", "prefill_step_size",
            "prefill_budget",
            "memory_budget_bytes")
    mine = {k: getattr(config, k) for k in keys}
    if mine["memory_budget_bytes"] is None:
        mine["memory_budget_bytes"] = default_budget()
    return dataclasses.replace(config, **distributed.broadcast_json(mine, group))


class Leader(distributed.Leader):
    """Rank 0's Engine as the gateway sees it (`engine.distributed.Leader`), answering a
    lost rank the server's way: 503 to everything in flight and to come, uvicorn
    stopped, exit 3. Worker thread only (but `fail`, `stop_followers`)."""

    rank_lost = RankLost
    raise_on_loss = False               # the gateway's jobs get the 503 (`fail`)
    loss_note = f"; answering 503 and exiting with status {EXIT_RANK_LOST}"

    def __init__(self, state, timeout: float, group=None):
        super().__init__(state.engine, timeout, group, name="engine-serve")
        self.state = state
        self.server = None              # the uvicorn server (set by the CLI): stopped on a loss
        # after a loss: seconds until uvicorn is told to stop, then until the process ends
        self.grace = (1.0, 5.0)
        self.shutdown_grace = SHUTDOWN_GRACE_S

    def stop_followers(self) -> None:
        """Send "stop" (on the worker, once the running requests are done). Any thread."""
        if self.dead.is_set() or self.stopped:
            return
        try:
            self.state.gateway.call(self.send_stop).result(self.dog.timeout + 5)
        except Exception as e:          # (a TimeoutError: the worker is stuck)
            self.fail(f"stopping: {type(e).__name__}: {e}")

    def fail(self, reason: str) -> bool:
        """A rank is lost: 503 to everything in flight and to come, then exit 3. Any thread."""
        if not super().fail(reason):
            return False
        self.state.gateway.abandon(RankLost(reason))
        threading.Thread(target=self._exit_soon, name="tp-exit", daemon=True).start()
        return True

    def hung(self, reason: str) -> None:
        self.fail(reason)               # (the exit follows the 503s)

    def _exit_soon(self) -> None:
        time.sleep(self.grace[0])       # the 503s go out (new requests get theirs too)
        if self.server is not None:
            self.server.should_exit = True
        time.sleep(self.grace[1])       # a worker stuck in a collective never returns
        self.exit_lost()

    def close(self) -> int:
        """At shutdown (main thread): followers get "stop". Returns the exit status."""
        self.stop_followers()
        self.dog.stop()
        if self.dead.is_set():
            self.exit_lost()
        return 0


def lead(state, timeout: float, app, server) -> Leader:
    """Make rank 0's gateway drive every rank (after `build_state`, before serving):
    the gateway steps the `Leader`, ticks it when idle; the app answers 503 once a
    rank is lost, and `server` (uvicorn) is stopped then."""
    leader = Leader(state, timeout)
    leader.server = server
    # (uvicorn looks both up on the instance: its signal handler, and the coroutine
    # that ends a graceful shutdown; after it the followers are told to stop)
    handle_exit, shutdown = server.handle_exit, server.shutdown

    def on_signal(sig, frame):
        leader.on_shutdown_signal()
        # the requests of a rank lost now get their 503 before uvicorn cancels them
        cfg = server.config
        if cfg.timeout_graceful_shutdown is not None:
            cfg.timeout_graceful_shutdown = max(cfg.timeout_graceful_shutdown,
                                                SHUTDOWN_GRACE_S + leader.grace[0] + 1)
        handle_exit(sig, frame)

    async def stop_all(*a, **kw):
        import asyncio
        await shutdown(*a, **kw)
        await asyncio.to_thread(leader.stop_followers)
        if leader.dead.is_set():        # status 3, not the signal's (uvicorn raises it
            leader.exit_lost()          # again once serving ends)
    server.handle_exit, server.shutdown = on_signal, stop_all
    gw = state.gateway
    gw.engine = leader
    gw.on_tick, gw.tick_s = leader.tick, timeout / 4
    state.adapters = _NoMount(state.adapters)
    app.add_middleware(DeadGuard, leader=leader)
    gw.call(leader.tick)    # the first heartbeat; it also wakes the worker into ticking
    n = leader.group.size()
    print(f"engine-serve: tensor parallel over {n} rank{'s' * (n != 1)}: this rank (0) "
          f"serves, the others follow its steps; --tp-timeout {timeout:g} s",
          file=sys.stderr, flush=True)
    return leader


class _NoMount:
    """rank 0's adapter registry: listing and resolving work, mounting is refused (400)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def mount(self, *a, **kw):
        from engine import AdapterRequestError
        raise AdapterRequestError("adapters cannot be mounted on a --tensor-parallel server "
                                  "(the model's weights are sharded over the ranks)")


class DeadGuard:
    """ASGI middleware: once a rank is lost, every request is answered 503."""

    def __init__(self, app, leader: Leader):
        self.app, self.leader = app, leader

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.leader.dead.is_set():
            from starlette.responses import JSONResponse
            err = RankLost("a rank was lost")
            await JSONResponse(body_for(scope["path"], err), status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def follow(config, timeout: float) -> int:
    """A rank > 0: load the shard, build the same engine, replay rank 0's steps."""
    from engine import KVConfigError
    from engine import ModelLoadError

    from .state import build_state

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
        return state.gateway.call_sync(
            lambda: distributed.Follower(state.engine, timeout, name="engine-serve").run())
    finally:
        state.gateway.close()
        time.sleep(0.2)
