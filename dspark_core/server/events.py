"""What flows between the engine thread and the event loop: a submission, its events, refusals."""

from __future__ import annotations

import asyncio
import itertools
import time

from attrs import define, field, frozen

from dspark_core.engine.request import Request, RequestOutput, SamplingParams
from dspark_core.server.fields import ApiError

_ids = itertools.count()


@frozen
class Tokens:
    """New committed token ids of a streaming request (the step that finishes it sends Finished instead)."""

    ids: tuple[int, ...]


@frozen
class Finished:
    """The request ended; ``output`` is None only when it was cancelled before it ran."""

    reason: str
    output: RequestOutput | None


@frozen
class Failed:
    error: ApiError


@define(eq=False)
class Submission:
    """One accepted request as both threads see it; the loop side reads ``events``."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float = field(factory=time.monotonic)
    sid: int = field(factory=lambda: next(_ids))
    # written by the engine thread; readable by the loop once the final event arrived
    request: Request | None = None
    sent: int = 0
    first_token: float | None = None
    last_token: float | None = None
    done: bool = False
    client_request_id: str | None = None  # the request's X-Request-Id header, for the access log


def not_ready() -> ApiError:
    return ApiError(503, "the server is not ready: the cost table is not installed yet (startup calibration is "
                    "running); retry when /ready returns 200", code="not_ready", kind="unavailable_error")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="shutting_down", kind="unavailable_error")


def engine_failed(status: int, exc: BaseException) -> ApiError:
    # the exception's text stays in the server log: it may describe internals
    return ApiError(status, f"the engine failed and is not serving ({type(exc).__name__}; details are in the "
                    "server log)", code="engine_failed", kind="server_error")


def overloaded(pending: int, limit: int) -> ApiError:
    return ApiError(429, f"server overloaded: {pending} requests are already queued or running (limit {limit}); "
                    "retry later", code="server_overloaded", kind="overloaded_error")
