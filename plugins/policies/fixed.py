"""Fixed-width budgets: every request verifies min(k, K) drafted tokens.

``fixed`` with k=K is the classic full-width speculative decoding baseline;
``none`` is target-only decoding (no draft is run, one row per request).
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
from dspark_core.policy import TierChoice, TierContext, smallest_tier


@frozen
class FixedPolicy:
    """Verify exactly ``k`` drafted tokens per live request (capped by K)."""

    k: int | None = None  # None = full width K
    name: str = "fixed"
    uses_draft: bool = True
    tier_lag: int = 0
    reads_confidences: bool = False  # the tier follows from k and the caps alone

    def per_request(self, width: int) -> int:
        return width if self.k is None else min(self.k, width)

    def draft_depth_needed(self, width: int) -> int:
        """Tokens the draft must propose for this policy (a request bucket with a smaller draft depth
        proposes all K for it instead; see ``ModelRunner.depth_for``)."""
        return self.per_request(width)

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        wanted = ctx.request_bucket + int(np.minimum(caps, self.per_request(ctx.draft_width)).sum())
        return TierChoice(rows=smallest_tier(ctx, wanted))

    def split(self, kernels: object, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
              request_bucket: int) -> torch.Tensor:
        return torch.clamp(caps, max=self.per_request(confidences.shape[1])).to(torch.int64)


@frozen
class NoSpeculation:
    """Target-only decoding: no draft, one row per bucket slot."""

    name: str = "none"
    uses_draft: bool = False
    tier_lag: int = 0
    reads_confidences: bool = False

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        return TierChoice(rows=ctx.request_bucket)

    def split(self, kernels: object, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
              request_bucket: int) -> torch.Tensor:
        return torch.zeros_like(caps, dtype=torch.int64)


@hookimpl
def dspark_components() -> list[Component]:
    return [
        Component("budget_policy", "fixed", "verify k drafted tokens per request (option k; default all K)"),
        Component("budget_policy", "none", "no speculation: target-only decoding"),
    ]


@hookimpl
def dspark_budget_policy(name: str, options: Mapping[str, Any]) -> FixedPolicy | NoSpeculation | None:
    if name == "none":
        if options:
            raise ConfigError(f"budget policy 'none' takes no options, got {sorted(options)}")
        return NoSpeculation()
    if name != "fixed":
        return None
    unknown = sorted(set(options) - {"k"})
    if unknown:
        raise ConfigError(f"budget policy 'fixed': unknown option(s) {unknown}; allowed: ['k']")
    k = options.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ConfigError(f"budget policy 'fixed': k must be an integer >= 0, got {k!r}")
    return FixedPolicy(k=k)
