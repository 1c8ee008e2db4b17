"""Running the app on uvicorn: in the foreground (``serve_http``) or on a background thread.

On SIGINT/SIGTERM uvicorn stops accepting connections and lets in-flight
responses finish (up to ``graceful_timeout`` seconds); then the app's lifespan
drains the engine service and stops its thread.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import uvicorn


class _Server(uvicorn.Server):
    """uvicorn's server, except that a handled SIGINT/SIGTERM ends ``serve_http`` normally.

    (Stock uvicorn re-raises the captured signal after its graceful shutdown,
    which kills the process with that signal's status.)
    """

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


def _config(app, host: str, port: int, log_level: str, graceful_timeout: float | None) -> uvicorn.Config:
    timeout = None if graceful_timeout is None else max(1, int(graceful_timeout))
    return uvicorn.Config(app, host=host, port=port, lifespan="on", log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=timeout)


def serve_http(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
               graceful_timeout: float | None = 30.0) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, then shut down gracefully and return."""
    server = _Server(_config(app, host, port, log_level, graceful_timeout))
    server.run()
    if not server.started:
        raise OSError(f"the HTTP server could not start on {host}:{port} (see the log above)")


class BackgroundServer:
    """uvicorn on a free loopback port in a daemon thread (tests, benchmarks, embedding).

    Usage: ``with BackgroundServer(app) as server: httpx.get(server.url + "/health")``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 graceful_timeout: float | None = 10.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(_config(app, self.host, self.port, log_level, graceful_timeout))
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
