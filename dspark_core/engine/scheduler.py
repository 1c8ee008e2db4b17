"""Continuous batching: requests join between steps and leave as soon as they finish.

The scheduler only decides *who* runs: it admits waiting requests while a slot
is free (up to the largest captured request bucket) and hands the runner the
newly admitted ones for prefill and the running ones for a decode step.
"""

from __future__ import annotations

from collections import deque

from dspark_core.engine.request import Request, Status
from dspark_core.engine.slots import SlotStorage


class Scheduler:
    """FIFO admission into a fixed number of slots."""

    def __init__(self, slots: SlotStorage, max_running: int, max_prefill_tokens: int = 8192) -> None:
        self.slots = slots
        self.max_running = min(max_running, slots.num_slots)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots; returns those that need prefill now."""
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running and self.slots.free_slots:
            head = self.waiting[0]
            # always admit one request even when its prompt alone exceeds the prefill budget
            if admitted and len(head.prompt) > budget:
                break
            self.waiting.popleft()
            head.slot = self.slots.acquire()
            head.status = Status.RUNNING
            budget -= len(head.prompt)
            self.running.append(head)
            admitted.append(head)
        return admitted

    def finish(self, request: Request, reason: str) -> int | None:
        """Mark ``request`` finished and take it out of the batch.

        Returns its slot, which the caller frees once no launched step still
        writes to it (with the task pipeline one may be in flight).
        """
        request.status = Status.FINISHED
        request.finish_reason = reason
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        slot, request.slot = request.slot, -1
        return slot if slot >= 0 else None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
