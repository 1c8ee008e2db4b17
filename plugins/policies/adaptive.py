"""The adaptive budget policy: maximise expected committed tokens per second.

For each captured tier G of the step's request bucket, the expected committed
tokens are one bonus token per live request plus the G - Bcap largest
survivals; dividing by the calibrated full-step cost of G gives tokens per
second. The scan covers every captured tier, because the cost curve is a
staircase and stopping at the first drop misses later, better tiers. Ties go
to the smaller tier. An optional minimum gain keeps full width unless the best
tier beats it by that fraction. Without a calibrated profile the step runs the
prewarmed full-width path and says so (``fallback``).

Two things keep adaptive from ever losing to target-only decoding:

* **Draft-off steps.** When the table has a calibrated draft-off cost, the
  host plans each step: if one token per request at the draft-off cost beats
  what drafted steps of this request bucket really bought lately, by more
  than ``draft_off_margin`` standard errors (the ``realized`` rule;
  ``confidence``: the best drafting tier on the freshest confidences), the
  step runs no draft at all. The ``timed`` rule judges the same way on
  measured step times instead of calibrated prices: each time a bucket's steps
  switch between drafting and not, the step's measured rate (tokens per request
  per second) is set against the other kind's recent rate, and while drafting
  the policy runs an occasional draft-off step (a *reference*) to keep that
  comparison fresh.
* **Honest forecasts.** Confidences from a draft's head are often optimistic
  (and the tier is picked from older ones). The policy keeps running sums of
  the drafted tokens it expected and the ones the target accepted, decayed per
  drafted step, and scales the expectation by their ratio.

With ``copy_steps``, a draft-off step still looks up copy proposals (the text the
request already holds, no draft forward) and verifies those that the table says
pay; such a step teaches the policy nothing about the draft.

Where ``--draft_depths`` cuts a bucket's block to d tokens, no request verifies
more than d, copy proposals included (``verify_past_depth`` lifts this): a
request verifying a long copy makes an attention band of its own, a cost the
table's price by rows does not hold. The planner cuts every request's cap to d
(:func:`~dspark_core.policy.verifies_past_depth`), so the tier choice and the
split see the same limit.

While the draft is off nothing new is learnt, so every so often the policy
drafts anyway (a *probe*) and judges that step with the raw confidences. The
gap between probes doubles after each probe that finds drafting still not
worth it, until a probe's extra cost spread over the gap is within
``probe_budget`` of the draft-off time (or the gap reaches
``max_probe_interval``), and resets as soon as drafting pays again. Under the
realized rule the gap does not grow while drafting measured within a standard
error of paying; see docs/plugins.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from attrs import define, field, frozen

from dspark_core.components import Component
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl
from dspark_core.policy import StepPlan, TierChoice, TierContext, allocate_split, best_rate_tier, tier_scores

if TYPE_CHECKING:
    from dspark_core.engine.records import StepReport

FIRST_PROBE_INTERVAL = 4
DEFAULT_MAX_PROBE_INTERVAL = 256
DEFAULT_PROBE_BUDGET = 0.01
DEFAULT_DRAFT_OFF_RULE = "realized"
DRAFT_OFF_RULES = ("confidence", "realized", "timed")
FIRST_REFERENCE_INTERVAL = 8
# timed rule: weight of each new step in the rate of a run of steps of one kind. Short memory, so a
# switch compares steps a few apart (contexts grow as requests decode, and step times with them).
RECENT_RATE_WEIGHT = 0.3
# ... and of the slower mean that decides whether a reference is due early (about ten steps: one
# request's drafted steps range 0.5-4x the draft-off rate, so three steps dip below it by chance)
SLOW_RATE_WEIGHT = 0.1
# This margin and the realized mean's memory (DEFAULT_REALIZED_DECAY) were chosen by
# replaying the policy over recorded held-out traces under exact, noisy and biased tables
# (benchmarks/policy_replay.py, benchmarks/results/policy-replay): the realized mean must be steady
# enough that a table pricing draft-off a little too cheap does not switch off a draft that pays.
# With a memory of 0.8 and no margin a 15 % too-cheap draft-off price cost 11 % at one request.
DEFAULT_DRAFT_OFF_MARGIN = 1.0
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
    advantage_steps: dict[int, int] = field(factory=dict)  # drafted steps measured (the weights follow from it)
    # about 20 drafted steps of memory: one step's ratio is noisy (0.5 to 4 on a CPU at concurrency 1),
    # so a shorter memory dips below 1 by chance; a draft that stops paying is still noticed within
    # a few tens of drafted steps (option ``realized_decay``)
    advantage_decay: float = DEFAULT_REALIZED_DECAY
    advantage_prior_steps: float = PRIOR_STEPS  # option ``realized_prior_steps``
    # timed rule: (request bucket, drafted) of the last timed step, and the measured rate (committed
    # tokens per live request per measured second) of the run of such steps it ended, recent steps weighing more
    last_timed: tuple[int, bool] | None = None
    run_rate: float = 0.0
    run_mean: float = 0.0  # the same run's rate with a longer memory (SLOW_RATE_WEIGHT)
    off_rate: dict[int, float] = field(factory=dict)  # per bucket, the rate of its latest draft-off run
    on_streak: int = 0  # drafted steps planned since the last draft-off one (timed rule's references)
    reference_interval: int = FIRST_REFERENCE_INTERVAL

    def record_timed(self, bucket: int, drafted: bool, rate: float) -> float | None:
        """One measured step of ``bucket``; returns the drafted/draft-off rate ratio it measured (None: no
        switch). Only a switch pairs the two kinds: the step against the run of the other kind that
        ended just before it, in the same bucket, so both sides saw nearly the same contexts and
        machine load. A step of another bucket in between breaks the pair."""
        ratio = None
        if self.last_timed == (bucket, not drafted) and self.run_rate > 0 and rate > 0:
            ratio = rate / self.run_rate if drafted else self.run_rate / rate
            self.record_advantage(bucket, ratio)
        if self.last_timed == (bucket, drafted):
            self.run_rate += RECENT_RATE_WEIGHT * (rate - self.run_rate)
            self.run_mean += SLOW_RATE_WEIGHT * (rate - self.run_mean)
        else:
            self.run_rate = self.run_mean = rate  # a new run starts
        self.last_timed = (bucket, drafted)
        if not drafted:
            self.off_rate[bucket] = self.run_rate
        return ratio

    def drafting_below_off(self, bucket: int) -> bool:
        """Whether the current run of drafted steps in ``bucket`` measures below its latest draft-off run, on
        the run's slower mean (one request's steps are too noisy for the recent rate). Not a fair comparison
        (that run may be many steps old), only a sign to measure a fair one soon."""
        off = self.off_rate.get(bucket)
        return off is not None and self.last_timed == (bucket, True) and self.run_mean < off

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
        steps = self.advantage_steps.get(bucket, 0) + 1
        self.advantage_steps[bucket] = steps
        weight = self._weights(steps)[0]
        for moments, value in ((self.advantage, ratio), (self.advantage_square, ratio * ratio)):
            previous = moments.get(bucket, 0.0)
            moments[bucket] = previous + (value - previous) / weight

    def _weights(self, steps: int) -> tuple[float, float]:
        """Sum of the step weights (1, d, d^2, ... over ``steps`` steps) and of their squares."""
        d = self.advantage_decay
        return (1 - d**steps) / (1 - d), (1 - d ** (2 * steps)) / (1 - d * d)

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
        steps = self.advantage_steps.get(bucket, 0)
        if steps == 0:
            return float("inf")
        weight, weight_square = self._weights(steps)
        mean, square = self.advantage.get(bucket, 0.0), self.advantage_square.get(bucket, 0.0)
        measured = max(square - mean * mean, 0.0)
        prior = self.advantage_prior_steps
        variance = (weight * measured + prior * PRIOR_VARIANCE / bucket) / (weight + prior)
        effective_steps = weight * weight / weight_square
        return float(np.sqrt(variance / effective_steps))


@frozen
class AdaptivePolicy:
    """Full tier scan with an optional minimum predicted gain over full width."""

    min_gain: float = 0.0
    tier_lag: int = 0
    name: str = "adaptive"
    uses_draft: bool = True
    draft_off: bool = True  # may plan draft-off steps when the table has their cost
    forecast_correction: bool = True  # scale expectations by realized / predicted
    max_probe_interval: int = DEFAULT_MAX_PROBE_INTERVAL
    # largest share of draft-off time that probing may add: where a drafting step costs much
    # more than a draft-off one (a CPU), probes grow rarer than where it is nearly free
    probe_budget: float = DEFAULT_PROBE_BUDGET
    # what decides draft-off: "confidence" (the best drafting tier on the freshest confidences),
    # "realized" (the decayed mean of what drafted steps really bought at calibrated prices, once one was
    # measured) or "timed" (the same mean of measured drafted/draft-off rate ratios, see record_timed)
    draft_off_rule: str = DEFAULT_DRAFT_OFF_RULE
    # realized rule: the draft goes off only while the measured mean stays below 1 by more than
    # this many standard errors of it
    draft_off_margin: float = DEFAULT_DRAFT_OFF_MARGIN
    # a draft-off step still looks up copy proposals and verifies them where the table says they pay
    # (copy steps, :func:`~dspark_core.policy.copy_step_choice`; needs a launch with copies)
    copy_steps: bool = True
    # False: where the draft proposes fewer than K tokens (a bucket's --draft_depths), no request verifies
    # more than that many, copy proposals included (the planner cuts the caps). A request verifying a long
    # copy gets an attention band of its own, which the table does not price
    # (benchmarks/results/amx/README.md, 2026-12-07)
    verify_past_depth: bool = False
    learning: DraftLearning = field(factory=DraftLearning, eq=False)

    def scores(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Expected tokens and tokens/second of every captured tier (NaN where not covered)."""
        return tier_scores(ctx, confidences, caps)

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        """The best tokens-per-second tier, kept at full width unless it gains ``min_gain``."""
        return best_rate_tier(ctx, confidences, caps, self.min_gain)

    split = staticmethod(allocate_split)

    def plan(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> StepPlan:
        """Draft or not, from the freshest confidences the host holds (see the module docstring)."""
        scale = self.learning.scale if self.forecast_correction else 1.0
        if not self.draft_off or ctx.draft_off_cost is None or ctx.tier_costs is None:
            return StepPlan(draft=True, forecast_scale=scale)
        measured = self.learning.advantage_bound(ctx.request_bucket, self.draft_off_margin)
        if self.draft_off_rule in ("realized", "timed") and measured is not None:
            worth_drafting = measured > 1.0
        else:
            _, rate = self.scores(attrs.evolve(ctx, forecast_scale=scale), confidences, caps)
            best_drafting = float(np.nanmax(rate)) if np.isfinite(rate).any() else float("nan")
            worth_drafting = not best_drafting <= ctx.live_requests / ctx.draft_off_cost  # NaN (nothing covered) drafts
        if worth_drafting:
            self.learning.off_streak = 0
            self.learning.probe_interval = FIRST_PROBE_INTERVAL
            if self.draft_off_rule == "timed" and self._reference_due(ctx.request_bucket):
                return StepPlan(draft=False, reference=True, forecast_scale=scale)
            return StepPlan(draft=True, forecast_scale=scale)
        if self.learning.off_streak >= self.learning.probe_interval:
            self.learning.off_streak = 0
            if self._probe_share(ctx, confidences, caps) > self.probe_budget and not self._near_even(ctx):
                self.learning.probe_interval = min(2 * self.learning.probe_interval, self.max_probe_interval)
            return StepPlan(draft=True, probe=True, forecast_scale=1.0)
        self.learning.off_streak += 1
        self.learning.on_streak = 0  # references count drafted steps in a row
        return StepPlan(draft=False, forecast_scale=scale)

    def _reference_due(self, bucket: int) -> bool:
        """Timed rule, while drafting: whether this step is a draft-off reference. Without one now and
        then, nothing measures what a draft-off step costs at today's contexts and load. The gap
        doubles while drafting pays clearly (the mean less ``draft_off_margin`` errors above 1) and a
        reference's loss, (A - 1) / A of a step at a measured advantage A, spread over the gap, is
        above ``probe_budget``; up to ``max_probe_interval``. Near break-even it starts over, since
        that is where the comparison decides something. It also starts over, with a reference at once,
        when the drafted steps since the last reference measure below it after at least the first gap
        or a quarter of the current one: a draft that stopped paying is then noticed within tens of
        steps, not hundreds."""
        learning = self.learning
        learning.on_streak += 1
        slipping = (learning.on_streak >= max(FIRST_REFERENCE_INTERVAL, learning.reference_interval // 4)
                    and learning.drafting_below_off(bucket))
        if learning.on_streak < learning.reference_interval and not slipping:
            return False
        learning.on_streak = 0
        mean = learning.advantage.get(bucket)
        low = learning.advantage_bound(bucket, -self.draft_off_margin)
        if slipping or mean is None or low is None or not low > 1.0:
            learning.reference_interval = FIRST_REFERENCE_INTERVAL
        elif (mean - 1.0) / mean / learning.reference_interval > self.probe_budget:
            learning.reference_interval = min(2 * learning.reference_interval, self.max_probe_interval)
        return True

    def _near_even(self, ctx: TierContext) -> bool:
        """Under the realized rule, drafting measured within one standard error of paying: probes stay
        frequent, since each probe is then about as likely to pay as not (one request on a CPU: a
        step's ratio ranges 0.8-4, so a few failed steps say little). Clearly below (many requests
        average out): the interval grows as under the confidence rule."""
        bound = self.learning.advantage_bound(ctx.request_bucket, 1.0)
        return self.draft_off_rule in ("realized", "timed") and bound is not None and bound >= 1.0

    def _probe_share(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> float:
        """Extra seconds of a probe (the tier the raw confidences pick) over the draft-off seconds
        of the gap before it: what probing at the current interval adds to decoding time."""
        costs = np.asarray(ctx.tier_costs, dtype=np.float64)
        rows = self.choose_tier(attrs.evolve(ctx, forecast_scale=1.0), confidences, caps).rows
        probe_cost = costs[ctx.tiers.index(rows)] if rows in ctx.tiers else float("nan")
        if not np.isfinite(probe_cost):  # not covered: assume the dearest covered tier
            probe_cost = float(np.nanmax(costs))
        off_cost = float(ctx.draft_off_cost)  # type: ignore[arg-type]  # plan() checked it is set
        return max(probe_cost - off_cost, 0.0) / (self.learning.probe_interval * off_cost)

    def observe(self, report: StepReport) -> None:
        """Learn realized / expected drafted tokens, and what drafting bought, from a processed step."""
        drafted = report.drafted
        if self.draft_off_rule == "timed" and not report.fallback:
            seconds = report.step_seconds
            if seconds is not None and seconds > 0 and report.live_requests > 0:
                # a copy step is the draft-off choice too: its rate is what not drafting bought
                rate = report.committed_tokens / (report.live_requests * seconds)
                self.learning.record_timed(report.request_bucket, drafted, rate)
        if not drafted or report.fallback or not np.isfinite(report.predicted_tokens):
            return  # a copy step says nothing about the draft
        if self.draft_off_rule != "timed":
            ratio = _drafting_advantage(report)
            if ratio is not None:
                self.learning.record_advantage(report.request_bucket, ratio)
        raw_expected = (report.predicted_tokens - report.live_requests) / max(report.forecast_scale, 1e-9)
        self.learning.record(max(raw_expected, 0.0), float(sum(report.accepted)))


def _drafting_advantage(report: StepReport) -> float | None:
    """A drafted step's committed tokens per calibrated second over the draft-off rate (None: unpriced)."""
    if report.tier_costs is None or not report.draft_off_cost or report.target_rows not in report.tiers:
        return None
    seconds = float(report.tier_costs[report.tiers.index(report.target_rows)])
    if not np.isfinite(seconds) or seconds <= 0:
        return None
    return (report.committed_tokens / seconds) / (report.live_requests / report.draft_off_cost)


def _options(name: str, options: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"budget policy {name!r}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")


def _flag(name: str, options: Mapping[str, Any], key: str, default: bool) -> bool:
    value = options.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"budget policy {name!r}: {key} must be true or false, got {value!r}")
    return value


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("budget_policy", "adaptive",
                      "argmax of expected tokens/second over all captured tiers and a draft-off step")]


@hookimpl
def dspark_budget_policy(name: str, options: Mapping[str, Any]) -> AdaptivePolicy | None:
    if name != "adaptive":
        return None
    _options(name, options, {"min_gain", "tier_lag", "draft_off", "forecast_correction", "max_probe_interval",
                             "probe_budget", "draft_off_rule", "draft_off_margin", "realized_decay",
                             "realized_prior_steps", "copy_steps", "verify_past_depth"})
    lag = options.get("tier_lag", 0)
    if isinstance(lag, bool) or not isinstance(lag, int) or lag not in (0, 1, 2):
        raise ConfigError(f"budget policy 'adaptive': tier_lag must be 0, 1 or 2, got {lag!r}")
    interval = options.get("max_probe_interval", DEFAULT_MAX_PROBE_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"budget policy 'adaptive': max_probe_interval must be an integer >= 1, got {interval!r}")
    budget = options.get("probe_budget", DEFAULT_PROBE_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ConfigError(f"budget policy 'adaptive': probe_budget must be a number in [0, 1], got {budget!r}")
    rule = options.get("draft_off_rule", DEFAULT_DRAFT_OFF_RULE)
    if rule not in DRAFT_OFF_RULES:
        raise ConfigError(f"budget policy 'adaptive': draft_off_rule must be one of {list(DRAFT_OFF_RULES)}, got {rule!r}")
    margin = options.get("draft_off_margin", DEFAULT_DRAFT_OFF_MARGIN)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin <= 10:
        raise ConfigError(f"budget policy 'adaptive': draft_off_margin must be a number in [0, 10], got {margin!r}")
    decay = options.get("realized_decay", DEFAULT_REALIZED_DECAY)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise ConfigError(f"budget policy 'adaptive': realized_decay must be a number in (0, 1), got {decay!r}")
    prior = options.get("realized_prior_steps", PRIOR_STEPS)
    if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0 <= prior <= 1000:
        raise ConfigError(f"budget policy 'adaptive': realized_prior_steps must be a number in [0, 1000], got {prior!r}")
    return AdaptivePolicy(min_gain=float(options.get("min_gain", 0.0)), tier_lag=lag, draft_off_rule=rule,
                          draft_off_margin=float(margin),
                          learning=DraftLearning(advantage_decay=float(decay), advantage_prior_steps=float(prior)),
                          draft_off=_flag(name, options, "draft_off", True),
                          forecast_correction=_flag(name, options, "forecast_correction", True),
                          copy_steps=_flag(name, options, "copy_steps", True),
                          verify_past_depth=_flag(name, options, "verify_past_depth", False),
                          max_probe_interval=interval, probe_budget=float(budget))
