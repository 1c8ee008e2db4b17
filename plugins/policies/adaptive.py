"""The adaptive budget policy: maximise expected committed tokens per second.

For each captured tier G of the step's request bucket, the expected committed
tokens are one bonus token per live request plus the G - Bcap largest
survivals; dividing by the calibrated full-step cost of G gives tokens per
second. The scan covers every captured tier, because the cost curve is a
staircase and stopping at the first drop misses later, better tiers. Ties go
to the smaller tier. An optional minimum gain keeps full width unless the best
tier beats it by that fraction. Without a calibrated profile the step runs the
prewarmed full-width path and says so (``fallback``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from attrs import frozen

from dspark_core.components import Component
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl
from dspark_core.policy import TierChoice, TierContext, allocate_split, full_width_choice, sorted_survival_prefix


@frozen
class AdaptivePolicy:
    """Full tier scan with an optional minimum predicted gain over full width."""

    min_gain: float = 0.0
    tier_lag: int = 0
    name: str = "adaptive"
    uses_draft: bool = True

    def scores(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Expected tokens and tokens/second of every captured tier (NaN where not covered)."""
        gains = sorted_survival_prefix(confidences, caps)
        draft_rows = np.minimum(np.asarray(ctx.tiers) - ctx.request_bucket, len(gains) - 1)
        expected = ctx.live_requests + gains[draft_rows]
        return expected, expected / ctx.tier_costs

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        if ctx.tier_costs is None or ctx.full_width not in ctx.tiers:
            return full_width_choice(ctx, fallback=True)
        expected, rate = self.scores(ctx, confidences, caps)
        full = ctx.tiers.index(ctx.full_width)
        if not np.isfinite(rate[full]):
            return full_width_choice(ctx, fallback=True)
        best = int(np.nanargmax(rate))  # first maximum = smallest tier among equals
        if rate[best] < rate[full] * (1.0 + self.min_gain):
            best = full
        return TierChoice(ctx.tiers[best], False, float(expected[best]), float(ctx.tier_costs[best]))

    split = staticmethod(allocate_split)


def _options(name: str, options: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"budget policy {name!r}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("budget_policy", "adaptive", "argmax of expected tokens/second over all captured tiers")]


@hookimpl
def dspark_budget_policy(name: str, options: Mapping[str, Any]) -> AdaptivePolicy | None:
    if name != "adaptive":
        return None
    _options(name, options, {"min_gain", "tier_lag"})
    lag = int(options.get("tier_lag", 0))
    if lag not in (0, 1, 2):
        raise ConfigError(f"budget policy 'adaptive': tier_lag must be 0, 1 or 2, got {lag}")
    return AdaptivePolicy(min_gain=float(options.get("min_gain", 0.0)), tier_lag=lag)
