"""A generation request and its per-request statistics."""

from __future__ import annotations

import enum
import itertools
from collections import deque

import numpy as np

from attrs import define, field, frozen

from dspark_core.convert import str_tuple

_ids = itertools.count()


@frozen
class SamplingParams:
    """Greedy decoding limits of one request."""

    max_tokens: int = 128
    stop: tuple[str, ...] = field(default=(), converter=str_tuple)
    ignore_eos: bool = False

    def __attrs_post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@define
class RequestStats:
    """Speculation statistics; acceptance = accepted / verified drafted tokens."""

    steps: int = 0
    drafted_verified: int = 0
    drafted_accepted: int = 0
    verify_widths: list[int] = field(factory=list)
    draft_off_steps: int = 0  # steps that ran no draft (one token committed)
    copy_steps: int = 0  # steps that ran no draft but verified copy proposals

    @property
    def acceptance(self) -> float:
        return self.drafted_accepted / self.drafted_verified if self.drafted_verified else 0.0

    @property
    def accepted_length(self) -> float:
        """Mean committed tokens per decode step, bonus included (tau)."""
        return (self.drafted_accepted + self.steps) / self.steps if self.steps else 0.0


@define(eq=False)
class Request:
    """One prompt being decoded. ``output`` holds committed token ids (prefill's first token included)."""

    prompt: list[int]
    params: SamplingParams
    request_id: str = field(factory=lambda: f"req-{next(_ids)}")
    status: Status = Status.WAITING
    slot: int = -1
    output: list[int] = field(factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(factory=RequestStats)
    text: str = ""  # detokenized output, set when stop strings are checked or at finish
    # (decode-step index, confidences) of the request's last drafted blocks as the host received them
    confidence_history: deque[tuple[int, np.ndarray]] = field(factory=lambda: deque(maxlen=4))

    @property
    def length(self) -> int:
        """Tokens in the sequence so far (prompt + committed output)."""
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    @property
    def anchor(self) -> int:
        """The last committed token: the next step's anchor row."""
        return self.output[-1]


@frozen
class RequestOutput:
    """A finished request as the API returns it."""

    request_id: str
    prompt_tokens: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    steps: int
    acceptance: float
    accepted_length: float
    verify_widths: tuple[int, ...]
    draft_off_steps: int = 0  # steps that ran no draft and verified nothing
    copy_steps: int = 0  # steps that ran no draft but verified copy proposals


def make_output(request: Request) -> RequestOutput:
    """Freeze a finished request into its output record."""
    s = request.stats
    return RequestOutput(request.request_id, len(request.prompt), tuple(request.output), request.text,
                         request.finish_reason or "length", s.steps, s.acceptance, s.accepted_length,
                         tuple(s.verify_widths), s.draft_off_steps, s.copy_steps)
