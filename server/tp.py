"""`engine-serve --tensor-parallel`: one server over the ranks of an `mx.distributed` launch.

    mlx.launch -n 2 --backend ring -- engine-serve --tensor-parallel --model DIR ...

Every rank loads the model sharded (`engine.load(..., tensor_parallel=True)`) and builds
the same `engine.Engine` (same flags; rank 0's memory budget). Rank 0 serves HTTP as
usual; its worker thread drives the engine through `Leader`, a stand-in for the Engine
that records each `submit` (prompt token ids, `SamplingParams`) and `abort`, and before
every `Engine.step()` broadcasts them with the word "step" (`engine.sharding.broadcast_json`).
Ranks > 0 serve nothing: `server.tp_follow.follow()` receives each message, makes the same calls on their
own Engine and steps it. So every rank runs the same forward on its shard, and the
all-reduces inside the sharded layers keep them in lockstep.

Tokens agree because every rank samples the same full logits (the LM head is whole on
every rank and the all-reduce hands every rank the same sums) with the same key: a
sampling request without a seed gets one drawn on rank 0 and sent with it. Each message
also carries the token ids rank 0's previous step produced; a rank that produced others
stops with an error instead of running on out of step.

A lost rank: a collective either fails (the ring reports the closed connection, in the
broadcast or inside the forward, where the engine ends the requests with that error),
hands back a partial sum, or blocks. A watchdog thread times every step and broadcast;
on a failure, or beyond `--tp-timeout` seconds, rank 0 answers every running and queued
request, and every new one, 503 in its protocol's shape, then exits with status 3. A step
that ends a request is confirmed by a heartbeat first (a partial sum can pick a stop
token). After SIGTERM/SIGINT (mlx.launch sends it when a rank exits) running requests may
finish, but a step that fails or hangs for SHUTDOWN_GRACE_S is a lost rank too. When
idle, rank 0 sends a heartbeat every `--tp-timeout / 4` seconds, so a follower whose
rank 0 is gone (or has stopped answering) exits with status 3 too.

Refused under tensor parallelism: adapters (`--adapter`, POST /v1/adapters: 400),
structured outputs and enforced tool choice (400: their grammar runs on rank 0 only),
and the L3 levers (`--tier`: a start-up error).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .errors import APIError, body_for

EXIT_RANK_LOST = 3
DEFAULT_TIMEOUT_S = 60.0
SHUTDOWN_GRACE_S = 3.0     # after SIGTERM/SIGINT, a step stuck this long means a lost rank
SEED_BITS = 63


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


# --- the messages ------------------------------------------------------------------


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
    from engine import SamplingParams
    d = dict(d)
    if d.get("logit_bias"):
        d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
    return SamplingParams(**d)


def digest(outs) -> list:
    return [[o.request_id, list(o.token_ids), o.finish_reason] for o in outs]


def agree_config(config, group=None):
    """Every rank takes rank 0's engine-shaping settings (one command line launched on
    every rank should agree already; the memory budget defaults to each machine's RAM)."""
    from engine.admission import default_budget
    from engine.sharding import broadcast_json

    keys = ("batch", "prompt_cache_bytes", "kv_quant", "kv_group_size", "prefill_step_size",
            "memory_budget_bytes")
    mine = {k: getattr(config, k) for k in keys}
    if mine["memory_budget_bytes"] is None:
        mine["memory_budget_bytes"] = default_budget()
    return dataclasses.replace(config, **broadcast_json(mine, group))


# --- timing every collective ------------------------------------------------------


class Watchdog:
    """Calls `on_stuck(reason)` once, when a section entered with `busy()` lasts over
    `timeout` seconds (checked twice a second, or ten times per timeout if shorter)."""

    def __init__(self, timeout: float, on_stuck, name: str):
        self.timeout = timeout
        self.on_stuck = on_stuck
        self.since: Optional[float] = None
        self._what = ""
        self._stop = threading.Event()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def busy(self, what: str) -> "_Section":
        return _Section(self, what)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tick = min(0.5, self.timeout / 10)
        while not self._stop.wait(tick):
            since = self.since
            if since is not None and time.monotonic() - since > self.timeout:
                self._stop.set()
                self.on_stuck(f"no answer within {self.timeout:g} s ({self._what})")


class _Section:
    def __init__(self, dog: Watchdog, what: str):
        self.dog, self.what = dog, what

    def __enter__(self):
        self.dog._what, self.dog.since = self.what, time.monotonic()

    def __exit__(self, *exc):
        self.dog.since = None


# --- rank 0 -----------------------------------------------------------------------


class Leader:
    """Rank 0's Engine as the gateway sees it: the real one, with every submit and abort
    recorded and broadcast before each step. Worker thread only (but `fail`)."""

    def __init__(self, state, timeout: float, group=None):
        from engine.sharding import group_or_world
        self._engine = state.engine
        self.state = state
        self.group = group_or_world(group)
        self.server = None              # the uvicorn server (set by the CLI): stopped on a loss
        self.dead = threading.Event()
        # after a loss: seconds until uvicorn is told to stop, then until the process ends
        self.grace = (1.0, 5.0)
        self.exit = os._exit            # (not sys.exit: the worker may be stuck in MLX)
        self.stopped = False
        self.stopping = False           # a stop signal came (on_shutdown_signal)
        self._ops: list = []
        self._check: list = []
        self._fail_lock = threading.Lock()
        self._exited = False
        self.dog = Watchdog(timeout, self.fail, "tp-watchdog")

    def __getattr__(self, name):       # stats(), batching, policy, check_context, ...
        return getattr(self._engine, name)

    def submit(self, prompt, params=None, *, request_id=None, adapter=(), **kw):
        from engine import SamplingParams
        from engine.request import encode_prompt

        if self.dead.is_set():
            raise RankLost("a rank was lost earlier")
        params = params or SamplingParams()
        if params.processor_factories:
            raise ValueError("structured outputs and enforced tool_choice are not available "
                             "on a --tensor-parallel server")
        if adapter or kw:
            raise ValueError("adapters, tools and template options are not available "
                             "through a --tensor-parallel engine (send token ids)")
        if params.seed is None and (params.resolved(self._engine.tokenizer).temperature or 0) > 0:
            params = dataclasses.replace(params, seed=secrets.randbits(SEED_BITS))
        ids = encode_prompt(self._engine.tokenizer, prompt)
        rid = self._engine.submit(ids, params, request_id=request_id)
        self._ops.append(Op("submit", rid, ids, params_to_json(params)))
        return rid

    def abort(self, request_id) -> bool:
        self._ops.append(Op("abort", str(request_id)))
        return self._engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return not self.dead.is_set() and not self.stopped and self._engine.has_unfinished()

    def _send(self, kind: str) -> None:
        from engine.sharding import broadcast_json
        msg, self._ops = Message(kind, self._ops, self._check), []
        broadcast_json(dataclasses.asdict(msg), self.group)

    def step(self) -> list:
        if self.dead.is_set() or self.stopped:
            return []
        try:
            with self.dog.busy("step"):
                self._send("step")
                outs = self._engine.step()
                self._check = digest(outs)
                lost = self._lost_in(outs)
        except Exception as e:          # the ring lost a peer (RuntimeError), or a bug:
            # either way the ranks can no longer be kept in step
            self.fail(_why(e))
            return []
        if lost is not None:
            self.fail(lost)
            return []
        return outs

    def _lost_in(self, outs) -> Optional[str]:
        """Whether a step's outputs mean a lost rank (the reason) or not (None). A fault
        in the forward ends requests with an error: a lost rank when it came from a
        collective, when a heartbeat then fails, or after a stop signal (under
        mlx.launch: a rank exited). A step that ends a request is confirmed by a
        heartbeat too: a ring that lost a peer may return partial sums, whose logits
        can pick a stop token (not to reach the client as a finished answer)."""
        from .gateway import client_error
        failed = [o for o in outs if o.finish_reason == "error" and not client_error(o)]
        for o in failed:
            if collective_failure(o.error):
                return _why(o.error)
        if failed or any(o.finished for o in outs):
            self._send("ping")          # raises (or blocks until the watchdog): lost
        if failed and self.stopping:
            return f"a step failed after the stop signal: {_why(failed[0].error)}"
        return None

    def _message(self, kind: str) -> None:
        """A message with no step (timed like a step)."""
        if self.dead.is_set() or self.stopped:
            return
        try:
            with self.dog.busy(kind):
                self._send(kind)
        except Exception as e:          # (see step)
            self.fail(_why(e))

    def tick(self) -> None:
        """Idle heartbeat (the gateway calls it when nothing arrives for a while)."""
        self._message("ping")

    def send_stop(self) -> None:
        self._message("stop")
        self.stopped = True

    def stop_followers(self) -> None:
        """Send "stop" (on the worker, once the running requests are done). Any thread."""
        if self.dead.is_set() or self.stopped:
            return
        try:
            self.state.gateway.call(self.send_stop).result(self.dog.timeout + 5)
        except Exception as e:          # (a TimeoutError: the worker is stuck)
            self.fail(f"stopping: {type(e).__name__}: {e}")

    def on_shutdown_signal(self) -> None:
        """SIGTERM/SIGINT: running requests may finish, but a step that now fails or
        hangs past SHUTDOWN_GRACE_S is a lost rank (the launcher stops every rank when
        one exits): their requests get the 503, not a cancellation. Any thread."""
        self.stopping = True
        self.dog.timeout = min(self.dog.timeout, SHUTDOWN_GRACE_S)

    def fail(self, reason: str) -> None:
        """A rank is lost: 503 to everything in flight and to come, then exit 3. Any thread."""
        with self._fail_lock:
            if self.dead.is_set():
                return
            self.dead.set()
        self.dog.stop()
        print(f"engine-serve: tensor parallel: lost a rank: {reason}; answering 503 and "
              f"exiting with status {EXIT_RANK_LOST}", file=sys.stderr, flush=True)
        self.state.gateway.abandon(RankLost(reason))
        threading.Thread(target=self._exit_soon, name="tp-exit", daemon=True).start()

    def _exit_soon(self) -> None:
        time.sleep(self.grace[0])       # the 503s go out (new requests get theirs too)
        if self.server is not None:
            self.server.should_exit = True
        time.sleep(self.grace[1])       # a worker stuck in a collective never returns
        self.exit_lost()

    def exit_lost(self) -> None:
        """Exit with EXIT_RANK_LOST, once (uvicorn's shutdown and the timer both get here)."""
        with self._fail_lock:
            if self._exited:
                return
            self._exited = True
        self.exit(EXIT_RANK_LOST)

    def close(self) -> int:
        """At shutdown (main thread): followers get "stop". Returns the exit status."""
        self.stop_followers()
        self.dog.stop()
        if self.dead.is_set():
            sys.stderr.flush()
            self.exit_lost()
        return 0


COLLECTIVE_ERRORS = ("[ring]", "[nccl]", "[mpi]", "[jaccl]", "a rank was lost")


def collective_failure(e: Optional[BaseException]) -> bool:
    """An error raised by a collective: MLX's distributed backends prefix theirs with
    the backend's name ("[ring] connection to a peer was lost"); `broadcast_json` says
    "a rank was lost" when a sum did not reach every rank."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in COLLECTIVE_ERRORS)


def _why(e: BaseException) -> str:
    return str(e) if type(e) is RuntimeError else f"{type(e).__name__}: {e}"


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
        from engine.adapters import AdapterRequestError
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


# --- ranks > 0 ----------------------------------------------------------------------
