"""What every cost model shares: samples, measurements, coverage and the protocol.

Units: every cost here is the wall-clock seconds of one FULL decode step
(draft + verify + commit + host work). Nothing adds draft or commit time on
top of a prediction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from attrs import field, frozen
from scipy.optimize import isotonic_regression

from dspark_core.convert import int_tuple, structure_checked
from dspark_core.errors import ConfigError
from dspark_core.fit_settings import ContextInterval
from dspark_core.geometry import full_width_rows, legal_tiers

T = TypeVar("T")


@frozen
class CostSample:
    """One calibration window: ``steps`` complete decode intervals took ``seconds``.

    ``context`` is the index of the interval in the calibration settings, or
    the interval itself. ``draft_off`` marks a window of draft-off steps (no
    draft run, ``target_rows`` = the bucket: one row per request).
    """

    request_bucket: int
    target_rows: int
    context: int | ContextInterval
    seconds: float
    steps: int
    draft_off: bool = False

    def __attrs_post_init__(self) -> None:
        if self.steps < 1 or not self.seconds > 0:
            raise ConfigError(f"a cost sample needs steps >= 1 and seconds > 0, got {self.steps} steps in {self.seconds} s")
        if self.draft_off and self.target_rows != self.request_bucket:
            raise ConfigError(f"a draft-off sample runs one row per request: bucket {self.request_bucket} "
                              f"needs target_rows {self.request_bucket}, got {self.target_rows}")

    @property
    def step_seconds(self) -> float:
        """Mean seconds of one full step in this window."""
        return self.seconds / self.steps


def measurement_tuple(values: Iterable[Measurement]) -> tuple[Measurement, ...]:
    """The measurements as a tuple (a typed attrs converter, see dspark_core.convert.int_tuple)."""
    return tuple(values)


@frozen
class Measurement:
    """Pooled windows of one probed point: mean full-step seconds over ``windows``."""

    request_bucket: int
    target_rows: int
    step_seconds: float
    windows: int
    draft_off: bool = False  # a draft-off point (tables written before it existed load as False)


def pool_samples(samples: Iterable[CostSample]) -> tuple[Measurement, ...]:
    """Pool windows per (bucket, rows, draft off): total seconds / total steps, sorted by point."""
    seconds: dict[tuple[int, int, bool], float] = defaultdict(float)
    steps: dict[tuple[int, int, bool], int] = defaultdict(int)
    windows: dict[tuple[int, int, bool], int] = defaultdict(int)
    for s in samples:
        key = (s.request_bucket, s.target_rows, s.draft_off)
        seconds[key] += s.seconds
        steps[key] += s.steps
        windows[key] += 1
    return tuple(Measurement(*key[:2], seconds[key] / steps[key], windows[key], key[2]) for key in sorted(seconds))


def drafting_samples(samples: Iterable[CostSample]) -> list[CostSample]:
    """The samples of steps that ran the draft (what the (bucket, rows) surface is fitted on)."""
    return [s for s in samples if not s.draft_off]


def draft_off_seconds(samples: Iterable[CostSample]) -> dict[int, float]:
    """Full-step seconds of draft-off steps per bucket, non-decreasing in the bucket.

    A draft-off step has one cost parameter of its own per bucket. Its
    least-squares value is the pooled mean of the bucket's windows (total
    seconds / total steps); where those means fall as the bucket grows, which
    only noise can do, the falling neighbours are pooled (a weighted isotonic
    regression, weighted by windows). The policy compares these costs with the
    drafting ones, so a noisy dip at one bucket would switch its draft off
    or on for the wrong reason.
    """
    pooled = pool_samples(s for s in samples if s.draft_off)  # sorted by bucket
    if not pooled:
        return {}
    fitted = isotonic_regression([m.step_seconds for m in pooled], weights=[m.windows for m in pooled]).x
    return {m.request_bucket: float(value) for m, value in zip(pooled, fitted)}


def check_draft_off_params(buckets: Sequence[int], seconds: Sequence[float], model: str) -> None:
    """Saved draft-off costs: one positive value per bucket, buckets positive and ascending."""
    if len(buckets) != len(seconds):
        raise ConfigError(f"{model} params: draft_off_seconds needs one value per draft_off_buckets entry")
    if list(buckets) != sorted(set(buckets)) or (buckets and buckets[0] < 1):
        raise ConfigError(f"{model} params: draft_off_buckets must be positive, ascending and unique, got {list(buckets)}")
    if any(not v > 0 for v in seconds):
        raise ConfigError(f"{model} params: draft_off_seconds must be > 0, got {list(seconds)}")


def check_grid(points: Iterable[tuple[int, int]], draft_width: int, model: str) -> None:
    """Every probed row count must be legal, and every bucket needs its full-width tier.

    ``points`` are the drafting points only; draft-off points are checked by :class:`CostSample`.
    """
    by_bucket: dict[int, set[int]] = defaultdict(set)
    for bucket, rows in points:
        legal = legal_tiers(bucket, draft_width)
        if rows not in legal:
            raise ConfigError(
                f"{model}: bucket {bucket} was probed at {rows} target rows, outside its legal range {legal[0]}..{legal[-1]} for K={draft_width}"
            )
        by_bucket[bucket].add(rows)
    missing = [b for b in sorted(by_bucket) if full_width_rows(b, draft_width) not in by_bucket[b]]
    if missing:
        wanted = ", ".join(f"bucket {b} at {full_width_rows(b, draft_width)} rows" for b in missing)
        raise ConfigError(f"{model}: the probe grid lacks full-width coverage; add {wanted} (K={draft_width})")
    if not by_bucket:
        raise ConfigError(f"{model}: no calibration samples to fit")


@frozen
class RowSpan:
    """Target rows ``min_rows..max_rows`` (inclusive) that a bucket can be predicted at."""

    request_bucket: int
    min_rows: int
    max_rows: int


def _spans(values: Iterable[RowSpan]) -> tuple[RowSpan, ...]:
    return tuple(values)  # a typed converter (see dspark_core.convert.int_tuple)


@frozen
class Coverage:
    """Where a fit answers. ``any_bucket`` is a row span usable by every bucket.

    Models fitted on a probe grid list one span per probed bucket; tables from
    other engines that never recorded buckets use ``any_bucket``.
    """

    spans: tuple[RowSpan, ...] = field(converter=_spans)
    any_bucket: tuple[int, int] | None = None
    # buckets with a calibrated draft-off step cost (empty: the policy never turns the draft off)
    draft_off_buckets: tuple[int, ...] = field(default=(), converter=int_tuple)

    def covers(self, request_bucket: int, target_rows: int, draft_width: int) -> bool:
        """True when the point is legal for ``draft_width`` and inside a span."""
        if not request_bucket <= target_rows <= full_width_rows(request_bucket, draft_width):
            return False
        if self.any_bucket is not None:
            return self.any_bucket[0] <= target_rows <= self.any_bucket[1]
        return any(
            s.request_bucket == request_bucket and s.min_rows <= target_rows <= s.max_rows for s in self.spans
        )

    def buckets(self) -> tuple[int, ...]:
        """Buckets with a span (empty when ``any_bucket`` is used)."""
        return tuple(s.request_bucket for s in self.spans)


def spans_within(buckets: Iterable[int], low: int, high: int, draft_width: int) -> tuple[RowSpan, ...]:
    """Per bucket, the legal rows clipped to ``low..high`` (buckets with none are dropped)."""
    out = []
    for b in sorted(set(buckets)):
        lo, hi = max(b, low), min(full_width_rows(b, draft_width), high)
        if lo <= hi:
            out.append(RowSpan(b, lo, hi))
    return tuple(out)


def interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float | None:
    """Piecewise-linear value at ``x``; None outside ``xs[0]..xs[-1]`` (never extrapolate)."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    lo, hi = 0, len(xs) - 1
    while hi - lo > 1:  # bisection: xs is sorted and may be long (every tier of K=7, B=16)
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    if xs[lo] == x or lo == hi:
        return float(ys[lo])
    if xs[hi] == x:
        return float(ys[hi])
    t = (x - xs[lo]) / (xs[hi] - xs[lo])
    return float(ys[lo] + t * (ys[hi] - ys[lo]))


def structure_params(data: Mapping[str, Any], cls: type[T], model: str) -> T:
    """Strictly structure a model's saved ``params``; errors name ``$.field``."""
    return structure_checked(data, cls, source=f"{model} params")


@runtime_checkable
class FittedCost(Protocol):
    """An immutable fit for one context interval."""

    model: str
    draft_width: int

    def predict_seconds(self, request_bucket: int, target_rows: int) -> float | None:
        """Full-step seconds at the point, or None when the point is not covered."""

    def predict_draft_off_seconds(self, request_bucket: int) -> float | None:
        """Full-step seconds of a draft-off step (no draft, one row per request), or None.

        Optional: a fit without this method is treated as having no draft-off cost.
        """

    @property
    def coverage(self) -> Coverage:
        """Buckets and target rows this fit answers for."""

    @property
    def params(self) -> dict[str, Any]:
        """JSON-able parameters; ``load(params)`` must give back an equal fit."""


@runtime_checkable
class CostModel(Protocol):
    """What the ``dspark_cost_model`` hook returns.

    Optional: ``check_grid(points, draft_width)`` (refuse a probe grid before any
    probing) and ``read_legacy(doc, source) -> (params, draft_width | None)``
    for a model that reads one of the legacy table layouts
    (:data:`dspark_core.costs.formats.LEGACY_FORMS`).
    """

    name: str

    def fit(self, samples: Sequence[CostSample], draft_width: int) -> FittedCost:
        """Fit samples of ONE context interval; raise ConfigError on an unusable grid."""

    def load(self, params: Mapping[str, Any], draft_width: int) -> FittedCost:
        """Rebuild a fit from saved ``params``; raise ConfigError on bad params."""
