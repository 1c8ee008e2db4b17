"""AsyncEngineService: the Engine on one dedicated thread behind an asyncio front end.

The thread runs the step loop while there is work and sleeps on a condition
when idle; others post to a locked inbox (requests, cancellations, calls) that
it drains between steps. Results return through one asyncio queue per request
(``loop.call_soon_threadsafe``): new token ids per step when streaming, then
one final event. At most ``max_pending`` requests are admitted (waiting or
running); the next one is refused at once with a 429 ApiError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dspark_core.engine.request import RequestOutput, SamplingParams
from dspark_core.errors import ConfigError, StartupAborted
from dspark_core.geometry import kv_reserve
from dspark_core.server import events
from dspark_core.server.events import Failed, Finished, Submission, Tokens

log = logging.getLogger(__name__)


class AsyncEngineService:
    """Runs ``engine`` on its own thread and serves asyncio callers."""

    def __init__(self, engine, *, max_pending: int = 256) -> None:
        """``engine`` is owned by the service from now on: touch it only through :meth:`call`."""
        if max_pending < 1:
            raise ConfigError(f"max_pending must be at least 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.max_model_len = engine.max_model_len
        self.draft_width = engine.config.draft_width
        self.reserve = kv_reserve(self.draft_width)  # the room the engine keeps for launched steps
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.runner.target.config.vocab_size
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, Any]] = deque()
        self.pending = 0  # admitted and not yet answered (written under _cond)
        self._live: dict[str, Submission] = {}  # engine thread only: request_id -> submission
        self._thread: threading.Thread | None = None
        self._stopping = self._closing = False
        self._ready = threading.Event()
        self.failure: BaseException | None = None
        self.waiting = self.running = 0  # engine-thread snapshots for metrics

    # -- control ----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
                self._thread.start()

    def mark_ready(self) -> None:
        """Declare the cost table installed: /ready turns 200 and generation requests are admitted."""
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self.unavailable() is None

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (e.g. calibration, then install_table)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post("call", (fn, future))
        return future

    def prepare(self, setup: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Start the thread, run ``setup(engine)`` on it (warmup, calibration, install_table), then mark
        ready; if ``setup`` raises, the service fails instead (/health and /ready answer 503)."""
        def run(engine):
            try:
                result = setup(engine)
            except StartupAborted as exc:
                log.warning("%s", exc)  # a shutdown during startup: nothing failed, but the table is not made
                raise
            except BaseException as exc:
                log.error("startup setup failed: %r", exc)
                self.failure = exc
                raise
            self.mark_ready()  # before the future resolves, so its waiters see the service ready
            return result

        self.start()
        return self.call(run)

    def unavailable(self) -> events.ApiError | None:
        """Why generation requests are refused right now (a 503), or None when they are admitted."""
        if self.failure is not None:
            return events.engine_failed(503, self.failure)
        if self._closing or self._stopping:
            return events.shutting_down()
        return None if self._ready.is_set() else events.not_ready()

    def submit(self, prompt: list[int], params: SamplingParams, *, stream: bool = False) -> Submission:
        """Admit a request (call from the event loop); raises ApiError 429/503 when it cannot be admitted."""
        if (refusal := self.unavailable()) is not None:
            raise refusal
        sub = Submission(prompt, params, stream, asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self.pending >= self.max_pending:
                raise events.overloaded(self.pending, self.max_pending)
            self.pending += 1
            self._inbox.append(("add", sub))
            self._cond.notify()
        return sub

    def cancel(self, sub: Submission) -> None:
        """Cancel a request whose client went away (thread-safe; a no-op once it finished)."""
        if not sub.done:
            self._post("cancel", sub)

    def stop(self, timeout: float | None = None) -> None:
        """Cancel whatever is still running, stop the thread and close the engine (blocking).

        Startup work still running (warmup, calibration) stops at its next step.
        """
        self._closing = True
        if not self._ready.is_set():
            self.engine.startup_abort.set()  # an Event: safe from this thread
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        else:
            self.engine.close()

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Graceful shutdown: refuse new requests, let admitted ones finish (up to the timeout), stop."""
        self._closing = True
        deadline = time.monotonic() + drain_timeout
        while self.pending and time.monotonic() < deadline and self.failure is None:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.stop)

    def _post(self, kind: str, item: Any) -> None:
        with self._cond:
            self._inbox.append((kind, item))
            self._cond.notify()

    # -- engine thread ------------------------------------------------------------
    def _has_work(self) -> bool:
        return self.engine.has_work

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._has_work() and not self._stopping:
                        self._cond.wait()
                    items = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                for kind, item in items:
                    self._apply(kind, item, stopping)
                if stopping:
                    for sub in list(self._live.values()):
                        self._cancel(sub, Failed(events.shutting_down()))
                if self._has_work():
                    self._publish(self.engine.step())
                elif stopping:
                    with self._cond:
                        if not self._inbox:
                            break
        except BaseException as exc:  # an engine bug: fail every request rather than hang them
            log.exception("engine thread failed")
            self.failure = exc
            self._fail_all(events.engine_failed(500, exc))
        finally:
            self.engine.close()

    def _apply(self, kind: str, item: Any, stopping: bool) -> None:
        if kind == "call":
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:
                    future.set_exception(exc)
        elif kind == "cancel":
            self._cancel(item, Finished("cancelled", None))
        elif stopping:
            self._finish(item, Failed(events.shutting_down()))
        else:
            try:
                item.request = self.engine.add_request(item.prompt, item.params)
            except (ConfigError, ValueError) as exc:
                self._finish(item, Failed(events.ApiError(400, str(exc), code="invalid_request")))
                return
            self._live[item.request.request_id] = item
        self._snapshot()

    def _cancel(self, sub: Submission, event: Finished | Failed) -> None:
        if sub.done:
            return
        if sub.request is not None:
            self.engine.cancel(sub.request)  # a no-op for a request that already finished
            self._live.pop(sub.request.request_id, None)
        self._finish(sub, event)

    def _publish(self, finished: list[RequestOutput]) -> None:
        now = time.monotonic()
        ending = {output.request_id for output in finished}
        for rid, sub in self._live.items():
            assert sub.request is not None  # set before a submission goes live
            produced = len(sub.request.output)
            if produced > sub.sent:
                if sub.first_token is None:
                    sub.first_token = now
                sub.last_token = now
                # a finishing request's last tokens travel in its Finished event (they may run past a stop string)
                if sub.stream and rid not in ending:
                    self._push(sub, Tokens(tuple(sub.request.output[sub.sent:produced])))
                sub.sent = produced
        for output in finished:
            ended = self._live.pop(output.request_id, None)
            if ended is not None:
                self._finish(ended, Finished(output.finish_reason, output))
        self._snapshot()

    def _finish(self, sub: Submission, event: Finished | Failed) -> None:
        sub.done = True
        self._push(sub, event)
        with self._cond:
            self.pending -= 1

    def _push(self, sub: Submission, event: Any) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.events.put_nowait, event)
        except RuntimeError:  # the client's event loop is closed: nobody is listening any more
            pass

    def _snapshot(self) -> None:
        s = self.engine.scheduler
        self.waiting, self.running = len(s.waiting), len(s.running)

    def _fail_all(self, error: events.ApiError) -> None:
        with self._cond:
            items, self._inbox = list(self._inbox), deque()
        for kind, item in items:
            if kind == "call":
                item[1].set_exception(RuntimeError(error.message))
        for sub in [i for k, i in items if k == "add"] + list(self._live.values()):
            if not sub.done:
                self._finish(sub, Failed(error))
        self._live.clear()
