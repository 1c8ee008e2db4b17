"""Other engines' budget rules, reimplemented so they face ours on equal terms.

Each runs on the same engine, graphs and calibrated costs as ``adaptive``; only
the rule differs. They are baselines for ``dspark-core bench``, not
recommendations.

* ``threshold`` (SpecDec++ / DeepSpec's evaluator): each request verifies its
  drafted tokens while their cumulative survival stays >= ``h``.
* ``argmax-notier``: maximise expected tokens / cost over the total number of
  verified tokens with a cost curve interpolated as if every row count had its
  own graph, deciding on confidences two steps old; the step then runs on the
  next captured tier up and the extra rows stay padding.
* ``stale-argmax``: argmax over the captured tiers with the cost curve made
  monotone in the rows; both the tier and the per-request split come from
  one-step-old confidences.
* ``min-gain``: the tier-aware argmax, but full width unless the predicted gain
  over full width is at least ``min_gain`` (default 4%).

The ages above are exact: the engine hands ``choose_tier`` confidences exactly
``tier_lag`` steps old, with or without schedule overlap (docs/plugins.md).
None of these rules plans draft-off steps or corrects its forecast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from attrs import frozen

from dspark_core.components import Component
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl
from dspark_core.policy import (StepPlan, TierChoice, TierContext, allocate_split, best_rate_tier, full_width_choice,
                                smallest_tier, sorted_survival_prefix)


def threshold_lengths(survival: torch.Tensor, caps: torch.Tensor, h: float) -> torch.Tensor:
    """Per request, how many leading drafted tokens keep cumulative survival >= h."""
    positions = torch.arange(survival.shape[1], device=survival.device)
    keep = (survival >= h) & (positions.unsqueeze(0) < caps.unsqueeze(1))
    return torch.cumprod(keep.to(torch.int64), dim=1).sum(dim=1)


@frozen
class ThresholdPolicy:
    """Stop each request where cumulative survival drops below ``h``."""

    h: float = 0.5
    name: str = "threshold"
    uses_draft: bool = True
    tier_lag: int = 0

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        survival = torch.from_numpy(np.cumprod(confidences, axis=1))
        wanted = ctx.request_bucket + int(threshold_lengths(survival, torch.from_numpy(caps), self.h).sum())
        return TierChoice(smallest_tier(ctx, wanted))

    def split(self, kernels: object, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
              request_bucket: int) -> torch.Tensor:
        lengths = threshold_lengths(torch.cumprod(confidences.float(), dim=1), caps, self.h)
        if request_bucket + int(lengths.sum()) <= choice.rows:
            return lengths
        # the tier came from older confidences: keep the highest-survival rows that fit
        return kernels.allocate(confidences, lengths, choice.rows - request_bucket)  # type: ignore[attr-defined]


@frozen
class ArgmaxNoTier:
    """Argmax over the verified-token count with an interpolated, tier-blind cost curve."""

    name: str = "argmax-notier"
    uses_draft: bool = True
    tier_lag: int = 2

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        if ctx.tier_costs is None:
            return full_width_choice(ctx, fallback=True)
        covered = np.isfinite(ctx.tier_costs)
        if not covered.any():
            return full_width_choice(ctx, fallback=True)
        tiers, costs = np.asarray(ctx.tiers)[covered], ctx.tier_costs[covered]
        gains = sorted_survival_prefix(confidences, caps)
        rows = ctx.request_bucket + np.arange(len(gains))
        inside = rows <= tiers[-1]
        cost = np.interp(rows[inside], tiers, costs)
        expected = ctx.live_requests + gains[inside]
        best = int(np.argmax(expected / cost))
        return TierChoice(smallest_tier(ctx, int(rows[best])), False, float(expected[best]), float(cost[best]),
                          draft_rows=best)

    split = staticmethod(allocate_split)


@frozen
class StaleArgmax:
    """Tier-aware argmax on a monotone cost curve; tier and split from one-step-old confidences."""

    name: str = "stale-argmax"
    uses_draft: bool = True
    tier_lag: int = 1

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        if ctx.tier_costs is None or not np.isfinite(ctx.tier_costs).all():
            return full_width_choice(ctx, fallback=True)
        monotone = TierContext(ctx.request_bucket, ctx.live_requests, ctx.draft_width, ctx.tiers,
                               np.maximum.accumulate(ctx.tier_costs))
        choice = best_rate_tier(monotone, confidences, caps)
        survival = np.cumprod(confidences, axis=1)
        lengths = _top_m_lengths(survival, caps, choice.rows - ctx.request_bucket)
        return TierChoice(choice.rows, choice.fallback, choice.predicted_tokens, choice.predicted_seconds,
                          lengths=tuple(int(x) for x in lengths))

    split = staticmethod(allocate_split)


@frozen
class MinGainPolicy:
    """The tier argmax of ``adaptive`` with a guard: full width unless the gain is at least ``min_gain``.

    Like the other peers it drafts on every step and takes the confidences at
    face value (no draft-off steps, no forecast correction).
    """

    min_gain: float = 0.04
    name: str = "min-gain"
    uses_draft: bool = True
    tier_lag: int = 0

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        return best_rate_tier(ctx, confidences, caps, self.min_gain)

    split = staticmethod(allocate_split)

    def plan(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> StepPlan:
        """Always draft, with the confidences unscaled."""
        return StepPlan(draft=True, forecast_scale=1.0)


def _top_m_lengths(survival: np.ndarray, caps: np.ndarray, m: int) -> np.ndarray:
    """Host version of the allocate rule (position-major stable order) for a stale split."""
    batch, width = survival.shape
    allowed = np.arange(width)[None, :] < caps[:, None]
    values = np.where(allowed, survival, -1.0).T.reshape(-1)
    order = np.argsort(-values, kind="stable")[: max(0, min(m, int(allowed.sum())))]
    return np.bincount(order % batch, minlength=batch)


PEERS = {
    "threshold": "stop where cumulative survival < h (SpecDec++/DeepSpec evaluator rule)",
    "argmax-notier": "argmax tokens/cost on an interpolated curve, 2-step-old confidences, no tier awareness",
    "stale-argmax": "tier argmax on monotone costs, tier and split from 1-step-old confidences",
    "min-gain": "tier argmax, full width unless the predicted gain is >= min_gain (4%)",
}


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("budget_policy", name, summary) for name, summary in PEERS.items()]


@hookimpl
def dspark_budget_policy(name: str, options: Mapping[str, Any]) -> Any:
    if name not in PEERS:
        return None
    allowed = {"threshold": {"h"}, "min-gain": {"min_gain"}}.get(name, set())
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"budget policy {name!r}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")
    if name == "threshold":
        h = float(options.get("h", 0.5))
        if not 0.0 <= h <= 1.0:
            raise ConfigError(f"budget policy 'threshold': h must be in [0, 1], got {h}")
        return ThresholdPolicy(h)
    if name == "min-gain":
        # other engines' rule: no draft-off steps and no forecast correction
        return MinGainPolicy(min_gain=float(options.get("min_gain", 0.04)))
    return ArgmaxNoTier() if name == "argmax-notier" else StaleArgmax()
