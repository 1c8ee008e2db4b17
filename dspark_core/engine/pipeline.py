"""The task pipeline: device work runs in order on one executor, at most two steps in flight.

With schedule overlap the host prepares and launches step t+1 while step t
still runs; step t's results come back through its future (the CPU stand-in
for a device event) and are processed while t+1 executes. Without overlap each
job runs inline and its result is ready at once. Submitting a third job blocks
until the oldest finishes (backpressure).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from attrs import define


@define
class Job:
    """A launched unit of device work and what the host needs to interpret its result."""

    kind: str  # "prefill" or "decode"
    requests: list
    slots: frozenset[int]
    future: Future
    context: Any = None


class DeviceQueue:
    """Ordered device execution; ``depth`` 1 runs inline, 2 overlaps host and device."""

    def __init__(self, overlap: bool) -> None:
        self.depth = 2 if overlap else 1
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-device") if overlap else None
        self.in_flight: deque[Job] = deque()

    def submit(self, kind: str, requests: list, fn: Callable[..., Any], *args: Any, context: Any = None) -> Job:
        if self._executor is None:
            future: Future = Future()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # surfaced to the host when it reads the job
                future.set_exception(exc)
        else:
            future = self._executor.submit(fn, *args)
        job = Job(kind, requests, frozenset(r.slot for r in requests), future, context)
        self.in_flight.append(job)
        return job

    def over_depth(self) -> bool:
        """True while more jobs are in flight than the pipeline allows after a launch."""
        return len(self.in_flight) >= self.depth

    def pop_oldest(self) -> tuple[Job, Any]:
        """Wait for the oldest job and return it with its result (re-raising device errors)."""
        job = self.in_flight.popleft()
        return job, job.future.result()

    def unprocessed_tokens(self) -> Counter[Any]:
        """Per request, the tokens its launched but unprocessed jobs commit at least: one per job,
        since a prefill commits its first token and a decode step its bonus token."""
        return Counter(request for job in self.in_flight for request in job.requests)

    def slots_in_flight(self) -> set[int]:
        return {slot for job in self.in_flight for slot in job.slots}

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
