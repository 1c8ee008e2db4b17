"""Running the app on uvicorn: in the foreground (``serve_http``) or on a background thread.

On SIGINT/SIGTERM uvicorn stops accepting connections and lets in-flight
responses finish (up to ``graceful_timeout`` seconds); then the app's lifespan
drains the engine service and stops its thread.

Connections are guarded by :class:`HttpLimits` (uvicorn alone has no limit on
how long a client may take to send its request head): a request head must
arrive within ``header_timeout`` seconds (a partial one is answered 408, an
idle connection just closed), heads are capped in size, idle keep-alive
connections close after ``keep_alive_timeout`` seconds, and connections beyond
``max_connections`` are answered 503 at once. Every such refusal carries the
OpenAI error body. Slow request bodies are the app's business (``build_app``'s
``body_timeout``).

uvicorn gets no logging configuration of its own: its loggers are bridged into
structlog (:func:`dspark_core.audit.bridge_stdlib_logging`), so its lines look
like every other line the process writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import threading
import time

import h11
import uvicorn
from attrs import frozen
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark_core.audit import bridge_stdlib_logging
from dspark_core.errors import ConfigError
from dspark_core.server.fields import ApiError

_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


@frozen
class HttpLimits:
    """Per-connection limits of the HTTP server (see the module docstring)."""

    header_timeout: float = 10.0
    keep_alive_timeout: int = 5
    max_header_bytes: int = 32 * 1024
    max_connections: int = 512


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus deadlines on request heads and drained bodies, a connection cap and
    JSON protocol errors.

    One timer per connection: while the connection waits for a request head
    it bounds the head (``header_timeout``); after an early response (a 413,
    415, ...) while the unread body is still arriving and being discarded, it
    bounds that too. While the app handles a request it is off: the app bounds
    body reads itself.
    """

    limits = HttpLimits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind: str | None = None
        if len(self.connections) > self.limits.max_connections:
            self._answer(ApiError(503, f"too many open connections (limit {self.limits.max_connections}); retry "
                                  "later", code="too_many_connections", kind="overloaded_error"))
            return
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_long(data):
            self.send_400_response("request head too long")
            return
        super().data_received(data)
        self._update_deadline()

    def _head_too_long(self, data: bytes) -> bool:
        """h11 checks its size limit only while a head is incomplete, so a big head that arrives
        in one read would pass: measure it here."""
        pending = self.conn.trailing_data[0] + data
        ends = [i for i in (pending.find(b"\r\n\r\n"), pending.find(b"\n\n")) if i >= 0]
        return (min(ends) if ends else len(pending)) > self.limits.max_header_bytes

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def connection_lost(self, exc) -> None:
        self._set_timer(None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._set_timer(None)
        self._answer(ApiError(400, "malformed HTTP request: bad request line or header syntax, or a request head "
                              f"over {self.limits.max_header_bytes} bytes", code="bad_http_request"))

    def _update_deadline(self) -> None:
        if self.transport.is_closing():
            self._set_timer(None)
        elif self.conn.their_state is h11.IDLE:
            self._set_timer("head")
        elif self.conn.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self._set_timer("drain")  # answered before the body was read: it is being discarded
        else:
            self._set_timer(None)

    def _set_timer(self, kind: str | None) -> None:
        if kind is not None and kind == getattr(self, "_timer_kind", None):
            return  # already running: a trickle of bytes does not extend the deadline
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
        self._timer, self._timer_kind = None, kind
        if kind is not None:
            self._timer = self.loop.call_later(self.limits.header_timeout, self._expired, kind)

    def _expired(self, kind: str) -> None:
        self._timer = self._timer_kind = None
        if self.transport.is_closing():
            return
        if kind == "head" and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._answer(ApiError(408, f"request head: not received within {self.limits.header_timeout:g} s",
                                  code="request_timeout"))
        else:  # an idle connection, or a discarded body that keeps coming: nothing left to answer
            self.transport.close()

    def _answer(self, error: ApiError) -> None:
        """Write a complete error response outside h11's state machine and close the connection."""
        body = json.dumps(error.body()).encode()
        head = [f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close"]
        if error.status == 503:
            head.append("retry-after: 1")
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self.transport.close()


def protocol_with(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class _Server(uvicorn.Server):
    """uvicorn's server, except that a handled SIGINT/SIGTERM ends ``serve_http`` normally.

    (Stock uvicorn re-raises the captured signal after its graceful shutdown,
    which kills the process with that signal's status.)
    """

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if sockets and self.started:  # uvicorn names the address only for sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                    f"[{host}]" if ":" in host else host, port)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _config(app, host: str, port: int, log_level: str, graceful_timeout: float | None,
            limits: HttpLimits | None) -> uvicorn.Config:
    timeout = None if graceful_timeout is None else max(1, int(graceful_timeout))
    limits = limits or HttpLimits()
    # uvicorn's own log format is replaced by structlog's: no uvicorn logging config,
    # its loggers (and the server's stdlib ones) go through the structlog bridge
    bridge_stdlib_logging()
    return uvicorn.Config(app, host=host, port=port, lifespan="on", log_level=log_level, log_config=None,
                          access_log=False,
                          timeout_graceful_shutdown=timeout, http=protocol_with(limits),
                          timeout_keep_alive=limits.keep_alive_timeout,
                          h11_max_incomplete_event_size=limits.max_header_bytes)


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` before any model is loaded; uvicorn listens on it later.

    ``serve`` holds the port from its first second, so a port in use is a one-line
    error at once rather than after minutes of loading and calibration, and nothing
    can take the port while they run. The socket is bound but not listening until
    the HTTP server starts, so a client that connects during loading is refused at
    once, as if nothing were there, instead of waiting in the kernel's backlog.
    Raises ConfigError naming the address.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)  # a name that does not resolve says so
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server rebinds at once
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = "; another process is listening there: stop it or choose another --port" \
            if exc.errno == errno.EADDRINUSE else ""
        reason = exc.strerror if isinstance(exc, socket.gaierror) or not exc.errno else os.strerror(exc.errno)
        raise ConfigError(f"--host={host} --port={port}: cannot listen there: {reason}{hint}") from None
    return sock


def serve_http(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
               graceful_timeout: float | None = 30.0, limits: HttpLimits | None = None,
               sock: socket.socket | None = None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, then shut down gracefully and return.

    With ``sock`` (from :func:`bind_http_socket`) uvicorn serves on that socket, and
    ``host``/``port`` only name it in logs.
    """
    server = _Server(_config(app, host, port, log_level, graceful_timeout, limits))
    try:
        server.run(sockets=None if sock is None else [sock])
    except SystemExit:  # uvicorn exits the process when it cannot start (server.started stays False)
        pass
    if not server.started:
        raise ConfigError(f"the HTTP server could not start on {host}:{port} (see the log above)")


class BackgroundServer:
    """uvicorn on a free loopback port in a daemon thread (tests, benchmarks, embedding).

    Usage: ``with BackgroundServer(app) as server: httpx.get(server.url + "/health")``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 graceful_timeout: float | None = 10.0, limits: HttpLimits | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(_config(app, self.host, self.port, log_level, graceful_timeout, limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dspark-http", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful stop: in-flight responses finish, then the lifespan drains the service."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
