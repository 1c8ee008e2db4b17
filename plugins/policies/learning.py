"""What the adaptive policy learns from the steps it has run.

Two running estimates, both decayed per drafted step: how far the draft's raw
confidences over- or under-promise (the forecast scale), and, per request
bucket, what drafted steps really bought against the calibrated draft-off rate
(the realized advantage the draft-off rule compares with 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from attrs import define, field

if TYPE_CHECKING:
    from dspark_core.engine.records import StepReport

FIRST_PROBE_INTERVAL = 4  # draft-off steps before the first probe; the gap doubles from here
DEFAULT_REALIZED_DECAY = 0.95
# The prior spread of one drafted step's ratio to the draft-off rate, at one request: 0 to 5
# accepted tokens of a block make it range from ~0.9 to ~5 on a CPU (sd ~0.7). A step of B requests
# averages B such ratios, hence PRIOR_VARIANCE / B. Worth PRIOR_STEPS measured steps.
PRIOR_VARIANCE = 0.5
PRIOR_STEPS = 2.0


@define
class DraftLearning:
    """What the policy has learnt from realized acceptance (mutable, one per policy instance)."""

    decay: float = 0.7  # weight of the past per drafted step (about three steps of memory)
    prior: float = 2.0  # pseudo-tokens on both sides, so the scale starts at 1 ...
    expected: float = 2.0  # decayed sum of drafted tokens the raw confidences expected ...
    accepted: float = 2.0  # ... and of those the target accepted
    off_streak: int = 0  # draft-off steps planned since the last drafted one
    probe_interval: int = FIRST_PROBE_INTERVAL
    # per request bucket, the decayed mean over drafted steps of (tokens committed / calibrated step
    # seconds) over the draft-off rate (requests / draft-off seconds): what drafting really bought
    advantage: dict[int, float] = field(factory=dict)
    advantage_square: dict[int, float] = field(factory=dict)  # the same decayed mean of the ratio squared
    advantage_weight: dict[int, float] = field(factory=dict)  # the decayed sum of step weights (1 per step)
    advantage_weight_square: dict[int, float] = field(factory=dict)  # ... and of their squares
    # about 20 drafted steps of memory: one step's ratio is noisy (0.5 to 4 on a CPU at concurrency 1),
    # so a shorter memory dips below 1 by chance; a draft that stops paying is still noticed within
    # a few tens of drafted steps (option ``realized_decay``)
    advantage_decay: float = DEFAULT_REALIZED_DECAY
    advantage_prior_steps: float = PRIOR_STEPS  # option ``realized_prior_steps``

    @property
    def scale(self) -> float:
        """Accepted / expected, bounded so one unlucky stretch cannot zero the forecast."""
        return float(min(2.0, max(0.05, self.accepted / self.expected)))

    def record(self, expected: float, accepted: float) -> None:
        """One drafted step. A step that verified something replaces the decayed part of the
        past by what it saw. One that verified nothing (and so teaches nothing) replaces it by
        the prior instead, relaxing the scale back towards 1 so the policy tries verifying
        again rather than staying stuck at a low scale. (Mixing the prior into informative
        steps too kept the scale biased towards 1 when drafting was sparse: ~0.7 where the
        realized ratio was ~0.5 with the shipped draft on the CPU.)"""
        if expected > 0:
            self.expected = self.decay * self.expected + expected
            self.accepted = self.decay * self.accepted + accepted
        else:
            self.expected = self.decay * self.expected + (1 - self.decay) * self.prior
            self.accepted = self.decay * self.accepted + (1 - self.decay) * self.prior

    def record_advantage(self, bucket: int, ratio: float) -> None:
        """One drafted step's realized rate over the draft-off rate, in its request bucket. The mean
        weighs a step ``advantage_decay`` less per drafted step after it, normalised by the weights
        so far: the first step counts as one step, not as the whole past."""
        d = self.advantage_decay
        weight = d * self.advantage_weight.get(bucket, 0.0) + 1.0
        self.advantage_weight_square[bucket] = d * d * self.advantage_weight_square.get(bucket, 0.0) + 1.0
        for moments, value in ((self.advantage, ratio), (self.advantage_square, ratio * ratio)):
            previous = moments.get(bucket, 0.0)
            moments[bucket] = previous + (value - previous) / weight
        self.advantage_weight[bucket] = weight

    def advantage_bound(self, bucket: int, errors: float) -> float | None:
        """The bucket's measured mean plus ``errors`` standard errors of it (None: nothing measured)."""
        mean = self.advantage.get(bucket)
        return None if mean is None else mean + errors * self.advantage_error(bucket)

    def advantage_error(self, bucket: int) -> float:
        """Standard error of the bucket's decayed mean: the ratio's variance over the mean's effective
        number of steps. The variance starts from a prior (``advantage_prior_steps`` steps of
        ``PRIOR_VARIANCE / bucket``) that the measured spread outweighs as steps accumulate: a few
        identical steps (two blocks of which nothing was accepted) measure no spread at all, and
        taking that at face value would turn a draft off on one or two unlucky steps."""
        weight = self.advantage_weight.get(bucket, 0.0)
        if weight <= 0:
            return float("inf")
        mean, square = self.advantage.get(bucket, 0.0), self.advantage_square.get(bucket, 0.0)
        measured = max(square - mean * mean, 0.0)
        prior = self.advantage_prior_steps
        variance = (weight * measured + prior * PRIOR_VARIANCE / bucket) / (weight + prior)
        effective_steps = weight * weight / self.advantage_weight_square[bucket]
        return float(np.sqrt(variance / effective_steps))


def drafting_advantage(report: StepReport) -> float | None:
    """A drafted step's committed tokens per calibrated second over the draft-off rate (None: unpriced)."""
    if report.tier_costs is None or not report.draft_off_cost or report.target_rows not in report.tiers:
        return None
    seconds = float(report.tier_costs[report.tiers.index(report.target_rows)])
    if not np.isfinite(seconds) or seconds <= 0:
        return None
    return (report.committed_tokens / seconds) / (report.live_requests / report.draft_off_cost)
