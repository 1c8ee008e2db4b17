"""What a budget policy sees and returns each step.

A policy decides in two parts, mirroring the asynchronous pipeline:

0. ``plan`` on the host, when the step is built, decides whether the step runs
   the draft at all. A draft-off step verifies one row per request (the
   anchor); the draft still receives the target's hidden states, so drafting
   resumes later exactly where it would have. ``plan`` is optional: a policy
   without it always drafts (when ``uses_draft``).
1. ``choose_tier``, from confidences exactly ``tier_lag`` steps old (0: the
   step's own proposal), picks the target-row tier G among the bucket's
   captured tiers, using the installed cost table's per-tier costs;
2. ``split`` on the device, with the step's current confidences, divides the
   tier's ``G - Bcap`` draft rows among the requests (the allocate kernel).

After the host processes a step it calls the optional ``observe`` with the
step's :class:`~dspark_core.engine.records.StepReport`, so a policy can learn
from what was really accepted. Policies only change how much is verified,
never what is committed.
"""

from __future__ import annotations

import math
from itertools import accumulate
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from attrs import frozen

from dspark_core.device import host_to_device
from dspark_core.errors import PluginError
from dspark_core.geometry import full_width_rows

if TYPE_CHECKING:
    from dspark_core.engine.records import StepReport
    from dspark_kernels import KernelSet


@frozen
class TierContext:
    """Host-side facts for one step's tier decision."""

    request_bucket: int
    live_requests: int
    draft_width: int
    tiers: tuple[int, ...]  # captured target rows of this bucket, ascending
    tier_costs: np.ndarray | None  # seconds per tier (NaN = not covered); None = no calibrated profile
    # calibrated seconds of a draft-off step (one row per request, no draft run);
    # None: not calibrated (an older table) or the Bcap tier is not captured
    draft_off_cost: float | None = None
    # multiplier the host applies to the confidences' expected accepted tokens
    # (the policy's running realized/predicted ratio; 1.0 = trust the confidences)
    forecast_scale: float = 1.0

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
    draft_off: bool = False  # the step ran no draft: one row per request, nothing verified
    copy_only: bool = False  # the step ran no draft but verified copy proposals (a copy step)


@frozen
class StepPlan:
    """The host's decision for one step before it is launched."""

    draft: bool = True  # False: a draft-off step
    probe: bool = False  # True: drafting although it did not look worth it, to learn whether it pays again
    reference: bool = False  # True: draft-off although drafting looked worth it, to measure what draft-off costs
    forecast_scale: float = 1.0  # copied into the step's TierContext


def draft_off_choice(ctx: TierContext) -> TierChoice:
    """The choice recorded for a draft-off step: the bucket's smallest tier, one token per request."""
    seconds = float("nan") if ctx.draft_off_cost is None else ctx.draft_off_cost
    return TierChoice(rows=ctx.request_bucket, predicted_tokens=float(ctx.live_requests), predicted_seconds=seconds,
                      draft_off=True)


class BudgetPolicy(Protocol):
    """The object a ``dspark_budget_policy`` hook returns.

    Two more methods are optional (see :func:`plan_step`, :func:`observe_step`):
    ``plan(ctx, confidences, caps) -> StepPlan`` on the host with the freshest
    confidences it has without waiting, and ``observe(report) -> None`` after
    each processed step. So are the attributes ``reads_confidences`` (True when
    absent, see :func:`reads_confidences`) and ``verify_past_depth`` (True when
    absent, see :func:`verifies_past_depth`).
    """

    name: str
    uses_draft: bool  # False: target-only decoding, the draft is not run
    tier_lag: int  # age in steps of the confidences choose_tier receives (0: the step's own)

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice: ...

    def split(self, kernels: KernelSet, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
              request_bucket: int) -> torch.Tensor: ...


#: What every budget policy must have (the optional ones are read with getattr and a default).
POLICY_ATTRIBUTES = ("name", "uses_draft", "tier_lag", "choose_tier", "split")


def check_policy(name: str, policy: object) -> None:
    """Refuse, when it is selected, a policy object that lacks what :class:`BudgetPolicy` requires,
    naming it, rather than failing at its first step with an AttributeError."""
    missing = [attribute for attribute in POLICY_ATTRIBUTES if not hasattr(policy, attribute)]
    if missing:
        raise PluginError(f"budget policy {name!r} ({type(policy).__module__}.{type(policy).__qualname__}) lacks "
                          f"{', '.join(missing)}; a budget policy has {', '.join(POLICY_ATTRIBUTES)} "
                          "(see dspark_core.policy.BudgetPolicy)")


def check_choice(policy: BudgetPolicy, ctx: TierContext, choice: object) -> TierChoice:
    """``choice`` if it is a tier this step can run, else a PluginError naming the policy.

    Checked on the host every step, before anything is launched: a plain type test and a lookup
    in the bucket's few tiers. A drafted choice must be one of the bucket's captured tiers or full
    width (what :func:`smallest_tier` returns), a draft-off choice the bucket itself, one row per
    request.
    """
    if not isinstance(choice, TierChoice):
        raise PluginError(f"budget policy {policy.name!r}: choose_tier returned {type(choice).__name__}; "
                          "expected a dspark_core.policy.TierChoice")
    if choice.draft_off:
        runnable = choice.rows == ctx.request_bucket
    else:
        runnable = choice.rows in ctx.tiers or choice.rows == ctx.full_width
    if runnable:
        return choice
    legal = (ctx.request_bucket,) if choice.draft_off else sorted({*ctx.tiers, ctx.full_width})
    which = "a draft-off step has" if choice.draft_off else "the captured tiers are"
    raise PluginError(f"budget policy {policy.name!r} chose {choice.rows!r} target rows at request bucket "
                      f"{ctx.request_bucket}; {which} {', '.join(map(str, legal))} "
                      "(dspark_core.policy.smallest_tier rounds up to one)")


def reads_confidences(policy: object) -> bool:
    """Whether ``choose_tier`` looks at the confidences it is given (a policy says False through an
    attribute ``reads_confidences``). One that does not, at ``tier_lag`` 0, gets an empty
    ``[n, 0]`` array instead of the step's own confidences, so the host does not wait for the
    proposal between the two launches of the step."""
    return bool(getattr(policy, "reads_confidences", True))


def verifies_past_depth(policy: object) -> bool:
    """Whether a request may verify more tokens than the draft proposes in its bucket (``--draft_depths``),
    i.e. copy proposals past the depth. A policy says False through an attribute ``verify_past_depth``:
    the planner then cuts every request's cap to the depth, so the tier choice, a copy step's choice and
    the allocate kernel's split all stay within it."""
    return bool(getattr(policy, "verify_past_depth", True))


def step_draft_depth(policy: object, draft_depths: Mapping[int, int], request_bucket: int, width: int) -> int:
    """Tokens the draft proposes in a step of ``request_bucket`` under ``policy``: the bucket's draft depth
    (``draft_depths``, absent: all ``width``), or all of them for a policy whose ``draft_depth_needed(width)``
    (a fixed k) is above that depth, so that its rows are never spent on tokens nobody proposed."""
    depth = draft_depths.get(request_bucket, width)
    needed = getattr(policy, "draft_depth_needed", None)
    return width if needed is not None and needed(width) > depth else depth


def plan_step(policy: object, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> StepPlan:
    """The policy's plan for a step; policies without ``plan`` draft whenever they use a draft."""
    plan = getattr(policy, "plan", None)
    if plan is None:
        return StepPlan(draft=bool(getattr(policy, "uses_draft", True)))
    return plan(ctx, confidences, caps)


def observe_step(policy: object, report: StepReport) -> None:
    """Hand a processed step's report to the policy when it wants one (``observe`` is optional)."""
    observe = getattr(policy, "observe", None)
    if observe is not None:
        observe(report)


# Up to this many confidences (18 requests at K=7) the survivals are summed in plain Python. A
# step's tier choice handles a few dozen numbers, where numpy's fixed cost per call is most of the
# work (more so with caches cold after the model ran: 5-6 us a call on the development CPU), and
# with a tier chosen from the step's own proposal that work sits between two device launches. Both
# ways multiply and add the same float64 values in the same order, so their results are identical
# (a test checks it).
SMALL_BLOCK = 128


def sorted_survival_prefix(confidences: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Prefix sums of the survivals allowed by ``caps``, largest first: out[m] = best m-token gain."""
    return np.array(_survival_prefix(confidences, caps), dtype=np.float64)


def _survival_prefix(confidences: np.ndarray, caps: np.ndarray) -> list[float]:
    confidences = np.asarray(confidences, dtype=np.float64)
    caps = np.asarray(caps)
    if confidences.size > SMALL_BLOCK:
        surv = np.cumprod(confidences, axis=1)
        width = surv.shape[1]
        # the usual step caps nobody below the width, and then needs no mask
        kept = surv.ravel() if caps.min(initial=width) >= width else surv[np.arange(width)[None, :] < caps[:, None]]
        return [0.0, *np.cumsum(np.sort(kept)[::-1]).tolist()]
    values = []
    for row, cap in zip(confidences.tolist(), caps.tolist()):
        survival = 1.0
        for confidence in row[:max(cap, 0)]:
            survival *= confidence
            values.append(survival)
    values.sort(reverse=True)
    return list(accumulate(values, initial=0.0))


def smallest_tier(ctx: TierContext, rows: int) -> int:
    """The smallest captured tier holding ``rows`` (the full-width tier always exists)."""
    return next((g for g in ctx.tiers if g >= rows), ctx.full_width)


def full_width_choice(ctx: TierContext, *, fallback: bool) -> TierChoice:
    """Verify every drafted token (the prewarmed path used without a calibrated profile)."""
    return TierChoice(rows=ctx.full_width, fallback=fallback)


def tier_scores(ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expected committed tokens and tokens per second of every captured tier (NaN where not covered).

    A tier of G rows verifies the ``G - Bcap`` largest survivals allowed by
    ``caps`` plus one bonus token per live request; the drafted part is scaled
    by ``ctx.forecast_scale`` but never beyond the drafted rows actually
    verified. A tier whose cost is missing (NaN) or not positive is not
    covered. Needs ``ctx.tier_costs``.
    """
    expected, rate = _tier_scores(ctx, confidences, caps)
    return np.array(expected, dtype=np.float64), np.array(rate, dtype=np.float64)


def _tier_scores(ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> tuple[list[float], list[float]]:
    gains = _survival_prefix(confidences, caps)
    last, scale, live, bucket = len(gains) - 1, ctx.forecast_scale, ctx.live_requests, ctx.request_bucket
    expected = []
    for tier in ctx.tiers:
        draft_rows = min(tier - bucket, last)
        # a scaled expectation can never exceed the drafted tokens actually verified
        expected.append(float(live + min(scale * gains[draft_rows], draft_rows)))
    costs = np.asarray(ctx.tier_costs, dtype=np.float64).tolist()
    return expected, [tokens / cost if cost > 0 else math.nan for tokens, cost in zip(expected, costs)]


def best_rate_tier(ctx: TierContext, confidences: np.ndarray, caps: np.ndarray, min_gain: float = 0.0) -> TierChoice:
    """The captured tier with the most expected tokens per calibrated second (see :func:`tier_scores`).

    Ties go to the smaller tier. The full-width tier is kept unless the best
    one beats its rate by the fraction ``min_gain``. Without a calibrated cost
    for the full-width tier the choice is the full-width fallback. This is the
    rule of the ``adaptive`` policy, shared here so other policies (the peers)
    can use it without importing that plugin.
    """
    if ctx.tier_costs is None or ctx.full_width not in ctx.tiers:
        return full_width_choice(ctx, fallback=True)
    expected, rate = _tier_scores(ctx, confidences, caps)
    full = ctx.tiers.index(ctx.full_width)
    if not math.isfinite(rate[full]):
        return full_width_choice(ctx, fallback=True)
    best = rate.index(max(r for r in rate if r == r))  # NaN skipped; first maximum = smallest tier among equals
    if rate[best] < rate[full] * (1.0 + min_gain):
        best = full
    return TierChoice(ctx.tiers[best], False, expected[best], float(ctx.tier_costs[best]))


def copy_step_choice(ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
    """The tier of a copy step: a step the plan runs without the draft, whose proposal is the copy
    lookup alone (``confidences`` are the fitted copy confidences, zeros where nothing matched).

    The bucket's own tier is the draft-off step at its calibrated cost; a larger tier is priced at
    its calibrated drafted cost. A copy step runs no draft forward, but on the development CPU it
    measured as dear as a drafted step of the same rows (177.6 against 182.9 ms at 16 requests
    and 32 rows), so the proposal's share is not taken off. The copy confidences are fitted on
    their own, so the draft's forecast scale is not applied. The best rate wins, ties going to the
    draft-off step; without a draft-off cost or tier costs it is the draft-off step.
    """
    off = draft_off_choice(ctx)
    if ctx.tier_costs is None or ctx.draft_off_cost is None or not ctx.draft_off_cost > 0:
        return off
    gains = _survival_prefix(confidences, caps)
    best_rate, best = ctx.live_requests / ctx.draft_off_cost, off
    for tier, seconds in zip(ctx.tiers, np.asarray(ctx.tier_costs, dtype=np.float64).tolist()):
        draft_rows = min(tier - ctx.request_bucket, len(gains) - 1)
        if draft_rows <= 0 or not seconds > 0:  # nothing to verify, or not covered (NaN)
            continue
        tokens = ctx.live_requests + gains[draft_rows]
        if tokens / seconds > best_rate:
            best_rate = tokens / seconds
            best = TierChoice(tier, predicted_tokens=tokens, predicted_seconds=seconds, copy_only=True)
    return best


def allocate_split(kernels: KernelSet, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
                   request_bucket: int) -> torch.Tensor:
    """Default split: host-fixed lengths when the choice has them, else the allocate kernel over
    the wanted draft rows (by default all of the tier's, so padding is spent on real tokens)."""
    if choice.lengths is not None:
        return torch.minimum(host_to_device(choice.lengths, caps.device), caps)
    return kernels.allocate(confidences, caps, split_rows(choice, request_bucket))


def split_rows(choice: TierChoice, request_bucket: int) -> int:
    """The draft rows the allocate kernel divides: the choice's wanted rows, else all of the tier's
    rows past one anchor per bucket slot."""
    return choice.rows - request_bucket if choice.draft_rows is None else choice.draft_rows
