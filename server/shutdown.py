"""SIGTERM / SIGINT: answer everyone before exiting.

On the signal uvicorn stops listening and waits up to its graceful-shutdown timeout for the
open requests. Before that, `install` makes the gateway shed: every request that has produced
nothing yet (queued, waiting for a row, or arriving on a kept-alive connection) is answered
503 at once. Running generations get `--shutdown-timeout` seconds to finish; then each one
still running ends with the same 503 error -- a stream's final event is the protocol's error
event -- and uvicorn, whose own timeout is a little longer, closes the connections only after
those answers are written.

After the graceful shutdown uvicorn (>= 0.29) raises the signal again for the handler that was
there before it: with Python's default one a SIGTERM killed the process there, before
`engine-serve`'s own clean-up ran (the disk prompt cache's pending files were lost half
written, the followers of a tensor-parallel group were not stopped). `exit_through_finally`
makes that handler raise `Terminated`, so the server returns through its `finally`.
"""

from __future__ import annotations

import signal
import threading

from .errors import APIError

WRITE_S = 2.0       # uvicorn waits this much longer than the grace, for the error answers


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or later",
                    type="overloaded_error", code="server_shutting_down")


def install(server, gateway, grace_s: float) -> None:
    """Wrap `server.handle_exit` (uvicorn looks it up on the instance when it installs its
    signal handlers) so that the first signal sheds, then abandons after `grace_s`."""
    handle_exit = server.handle_exit
    started = threading.Event()

    def on_signal(sig, frame):
        if not started.is_set():
            started.set()
            err = shutdown_error()
            gateway.shed(err)
            timer = threading.Timer(grace_s, gateway.abandon, args=(err,))
            timer.daemon = True
            timer.start()
        handle_exit(sig, frame)

    server.handle_exit = on_signal
    cfg = server.config
    if cfg.timeout_graceful_shutdown is not None:
        cfg.timeout_graceful_shutdown = grace_s + WRITE_S


class Terminated(Exception):
    """SIGTERM, raised again by uvicorn once its graceful shutdown is done."""


def _raise_terminated(sig, frame):
    raise Terminated()


def exit_through_finally() -> None:
    """SIGTERM raises `Terminated` (main thread) instead of killing the process: call it
    before serving, catch `Terminated` around the serving, clean up in `finally`."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def second_signal_ends_at_once() -> None:
    """Once shutting down (finishing the disk cache's files, stopping followers), another
    SIGTERM or Ctrl-C ends the process at once, as the signal's default does, instead of
    raising inside that clean-up (a traceback, the clean-up cut anyway)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
