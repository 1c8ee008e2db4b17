"""What a budget policy sees and returns each step.

A policy decides in two parts, mirroring the asynchronous pipeline:

1. ``choose_tier`` on the host, from confidences that may be one or two steps
   old (``tier_lag``), picks the target-row tier G among the bucket's captured
   tiers, using the installed cost table's per-tier costs;
2. ``split`` on the device, with the step's current confidences, divides the
   tier's ``G - Bcap`` draft rows among the requests (the allocate kernel).

Policies only change how much is verified, never what is committed.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from attrs import frozen

from dspark_core.geometry import full_width_rows


@frozen
class TierContext:
    """Host-side facts for one step's tier decision."""

    request_bucket: int
    live_requests: int
    draft_width: int
    tiers: tuple[int, ...]  # captured target rows of this bucket, ascending
    tier_costs: np.ndarray | None  # seconds per tier (NaN = not covered); None = no calibrated profile

    @property
    def full_width(self) -> int:
        return full_width_rows(self.request_bucket, self.draft_width)


@frozen
class TierChoice:
    """The chosen tier, whether it is the uncalibrated full-width fallback, and the forecast."""

    rows: int
    fallback: bool = False
    predicted_tokens: float = float("nan")  # expected committed tokens this step
    predicted_seconds: float = float("nan")
    # draft rows the policy wants spent (None: every row of the tier, padding included)
    draft_rows: int | None = None
    # per-request verify lengths fixed on the host (a stale split); None: split on the device
    lengths: tuple[int, ...] | None = None


class BudgetPolicy(Protocol):
    """The object a ``dspark_budget_policy`` hook returns."""

    name: str
    uses_draft: bool  # False: target-only decoding, the draft is not run
    tier_lag: int  # 0: decides on current confidences; 1-2: on older ones

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice: ...

    def split(self, kernels: object, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
              request_bucket: int) -> torch.Tensor: ...


def sorted_survival_prefix(confidences: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Prefix sums of the survivals allowed by ``caps``, largest first: out[m] = best m-token gain."""
    surv = np.cumprod(np.asarray(confidences, dtype=np.float64), axis=1)
    width = surv.shape[1]
    allowed = np.arange(width)[None, :] < np.asarray(caps)[:, None]
    values = np.sort(surv[allowed])[::-1]
    return np.concatenate([[0.0], np.cumsum(values)])


def smallest_tier(ctx: TierContext, rows: int) -> int:
    """The smallest captured tier holding ``rows`` (the full-width tier always exists)."""
    return next((g for g in ctx.tiers if g >= rows), ctx.full_width)


def full_width_choice(ctx: TierContext, *, fallback: bool) -> TierChoice:
    """Verify every drafted token (the prewarmed path used without a calibrated profile)."""
    return TierChoice(rows=ctx.full_width, fallback=fallback)


def allocate_split(kernels: object, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
                   request_bucket: int) -> torch.Tensor:
    """Default split: host-fixed lengths when the choice has them, else the allocate kernel over
    the wanted draft rows (by default all of the tier's, so padding is spent on real tokens)."""
    if choice.lengths is not None:
        return torch.minimum(torch.tensor(choice.lengths, dtype=torch.int64, device=caps.device), caps)
    rows = choice.rows - request_bucket if choice.draft_rows is None else choice.draft_rows
    return kernels.allocate(confidences, caps, rows)  # type: ignore[attr-defined]
