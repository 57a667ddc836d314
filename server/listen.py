"""Listening for `engine-serve`: the socket, uvicorn with its h11 protocol adjusted, and a
server on a thread for tests and benchmarks.

- `bind(host, port)`: bind first, so a busy port fails before the model loads;
- `uvicorn_server(app, ...)`: uvicorn with an h11 protocol that ACKs each request segment
  at once, answers malformed requests with a JSON error, and times out slow headers;
- `BackgroundServer(app)`: the same served from a thread (`with BackgroundServer(app) as s`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time


def bind(host: str, port: int) -> socket.socket:
    """Bind first (so a busy port fails before the model loads)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when
    # the socket says it is TCP (`base_events._set_nodelay`); with proto 0, Nagle holds each
    # small SSE write behind the client's delayed ACK (+40 ms TTFT on keep-alive requests)
    sock = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"engine-serve: {host}:{port} is already in use (another server "
                             "is serving there?); pick another --port") from None
        raise SystemExit(f"engine-serve: cannot bind {host}:{port}: {e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _quick_ack(sock) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
    except (AttributeError, OSError):   # not Linux, or not TCP
        pass


def _h11_protocol(header_timeout_s: float = 10.0):
    """uvicorn's h11 protocol with three changes.

    - Each request segment is ACKed at once (TCP_QUICKACK): clients such as httpx
      (the openai/anthropic SDKs) write a request's headers and body separately;
      with Nagle on their side, the body waits for our ACK of the headers, which
      Linux delays by up to 40 ms on a keep-alive connection.
    - A malformed request (bad Content-Length or chunk size, headers over the limit)
      is answered with a JSON error body (uvicorn sends plain text).
    - The request line and headers must arrive within `header_timeout_s` of the
      connection (or of the request's first byte on a kept-alive connection): a
      client trickling headers (slowloris) gets a 408 and is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class QuickAckH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):
            self._qa_sock = transport.get_extra_info("socket")
            if self._qa_sock is not None:
                _quick_ack(self._qa_sock)
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data):
            if self._qa_sock is not None:
                _quick_ack(self._qa_sock)
            if self.conn.their_state is h11.IDLE and self._header_timer is None:
                self._arm_header_timer()      # first byte of a kept-alive request
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm_header_timer()

        def connection_lost(self, exc):
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self):
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self):
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self.conn.our_state is h11.IDLE:
                    self._send_json_error(408, "the request headers did not arrive within "
                                               f"{header_timeout_s:g} s")
                else:
                    self.transport.close()

        def send_400_response(self, msg):
            self._send_json_error(400, "malformed HTTP request (bad request line, headers, "
                                       "Content-Length or chunk encoding, or headers over "
                                       "the size limit)")

        def _send_json_error(self, status, message):
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                         "param": None, "code": None}}).encode()
            try:
                for event in (h11.Response(status_code=status, headers=[
                        (b"content-type", b"application/json"), (b"connection", b"close"),
                        (b"content-length", str(len(body)).encode())]),
                        h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return QuickAckH11Protocol


def uvicorn_server(app, log_level="warning", access_log=False, *, header_timeout_s=10.0,
                   max_header_bytes=16 * 1024, shutdown_timeout_s=10.0):
    import uvicorn
    cfg = uvicorn.Config(app, log_level=log_level.lower(), access_log=access_log,
                         lifespan="off", timeout_keep_alive=30, loop="asyncio",
                         http=_h11_protocol(header_timeout_s), ws="none",
                         h11_max_incomplete_event_size=max_header_bytes,
                         timeout_graceful_shutdown=shutdown_timeout_s)
    return uvicorn.Server(cfg)


class BackgroundServer:
    """Serve an app from a thread (tests, benchmarks): `with BackgroundServer(app) as s: s.url`."""

    def __init__(self, app, host="127.0.0.1", port=0, log_level="warning", **server_kw):
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = uvicorn_server(app, log_level, **server_kw)
        self.thread = threading.Thread(target=self._run, daemon=True, name="uvicorn")

    def _run(self):
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self, timeout: float = 30.0):
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
