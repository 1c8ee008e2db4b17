"""Steps-per-second cost model: a one-dimensional table over target rows G.

The table stores measured full steps per second at each probed G and
interpolates linearly between them. A step at G costs ``1000 / SPS(G)``
milliseconds, i.e. ``1 / SPS(G)`` seconds, which is what
``predict_seconds`` returns. The request bucket only limits coverage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import field, frozen

from dspark_core.components import Component
from dspark_core.convert import float_tuple, int_tuple, structure_checked
from dspark_core.costs.base import (
    Coverage,
    CostSample,
    check_draft_off_params,
    check_grid,
    draft_off_seconds,
    drafting_samples,
    interpolate,
    spans_within,
    structure_params,
)
from dspark_core.errors import ConfigError
from dspark_core.geometry import full_width_rows
from dspark_core.hookspecs import hookimpl

NAME = "sps"


def _optional_tuple(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


@frozen
class SpsParams:
    """Saved form. ``request_buckets`` None means any bucket (tables from other engines).

    ``max_rows`` optionally caps coverage below the largest probed G.
    """

    target_rows: tuple[int, ...] = field(converter=int_tuple)
    steps_per_second: tuple[float, ...] = field(converter=float_tuple)
    request_buckets: tuple[int, ...] | None = field(default=None, converter=_optional_tuple)
    max_rows: int | None = None
    # measured steps per second of draft-off steps (no draft, Bcap rows), per bucket
    draft_off_buckets: tuple[int, ...] = field(default=(), converter=int_tuple)
    draft_off_steps_per_second: tuple[float, ...] = field(default=(), converter=float_tuple)


@frozen
class SpsFit:
    """A fitted steps-per-second table for one context interval."""

    draft_width: int
    p: SpsParams
    model: str = NAME

    def __attrs_post_init__(self) -> None:
        p = self.p
        rows = list(p.target_rows)
        if not rows or rows != sorted(set(rows)) or rows[0] < 1:
            raise ConfigError(f"sps params: target_rows must be positive, ascending and unique, got {rows}")
        if len(p.steps_per_second) != len(rows):
            raise ConfigError("sps params: steps_per_second needs one value per target_rows entry")
        if any(not v > 0 for v in p.steps_per_second):
            raise ConfigError(f"sps params: steps_per_second must be > 0, got {list(p.steps_per_second)}")
        check_draft_off_params(p.draft_off_buckets, p.draft_off_steps_per_second, NAME)

    @property
    def _top(self) -> int:
        top = self.p.target_rows[-1]
        return top if self.p.max_rows is None else min(top, self.p.max_rows)

    def steps_per_second(self, target_rows: int) -> float | None:
        """Interpolated SPS at ``target_rows``; None outside the table."""
        if target_rows > self._top:
            return None
        return interpolate(self.p.target_rows, self.p.steps_per_second, target_rows)

    def predict_seconds(self, request_bucket: int, target_rows: int) -> float | None:
        """Seconds of one full step: 1 / SPS(G) (= 1000 / SPS(G) ms); None when not covered."""
        buckets = self.p.request_buckets
        if buckets is not None and request_bucket not in buckets:
            return None
        if not request_bucket <= target_rows <= full_width_rows(request_bucket, self.draft_width):
            return None
        sps = self.steps_per_second(target_rows)
        return None if sps is None else 1.0 / sps

    def predict_draft_off_seconds(self, request_bucket: int) -> float | None:
        """1 / SPS of the bucket's draft-off steps, or None when they were not probed."""
        p = self.p
        if request_bucket not in p.draft_off_buckets:
            return None
        return 1.0 / p.draft_off_steps_per_second[p.draft_off_buckets.index(request_bucket)]

    def predict_ms(self, request_bucket: int, target_rows: int) -> float | None:
        """The same cost in milliseconds: 1000 / SPS(G)."""
        if self.predict_seconds(request_bucket, target_rows) is None:
            return None
        sps = self.steps_per_second(target_rows)
        assert sps is not None  # covered points always have a table value
        return 1000.0 / sps

    @property
    def coverage(self) -> Coverage:
        """Probed buckets (or any bucket) at legal rows inside the table's span."""
        low, off = self.p.target_rows[0], self.p.draft_off_buckets
        if self.p.request_buckets is None:
            return Coverage((), (low, self._top), draft_off_buckets=off)
        return Coverage(spans_within(self.p.request_buckets, low, self._top, self.draft_width), draft_off_buckets=off)

    @property
    def params(self) -> dict[str, Any]:
        p = self.p
        return {
            "target_rows": list(p.target_rows),
            "steps_per_second": list(p.steps_per_second),
            "request_buckets": None if p.request_buckets is None else list(p.request_buckets),
            "max_rows": p.max_rows,
            "draft_off_buckets": list(p.draft_off_buckets),
            "draft_off_steps_per_second": list(p.draft_off_steps_per_second),
        }


def fit_sps(samples: Sequence[CostSample], draft_width: int) -> SpsFit:
    """SPS(G) = total steps / total seconds over every window probed at G (draft-off windows apart)."""
    off = draft_off_seconds(samples)
    samples = drafting_samples(samples)
    check_grid([(s.request_bucket, s.target_rows) for s in samples], draft_width, NAME)
    steps: dict[int, int] = defaultdict(int)
    seconds: dict[int, float] = defaultdict(float)
    for s in samples:
        steps[s.target_rows] += s.steps
        seconds[s.target_rows] += s.seconds
    rows = sorted(steps)
    buckets = sorted({s.request_bucket for s in samples})
    return SpsFit(draft_width, SpsParams(rows, [steps[g] / seconds[g] for g in rows], buckets,
                                         draft_off_buckets=sorted(off),
                                         draft_off_steps_per_second=[1.0 / off[b] for b in sorted(off)]))


@frozen
class LegacySpsDoc:
    """A steps-per-second table from before tables named their model (other engines' DSpark file)."""

    sample_batch_tokens: list[int]
    sample_steps_per_sec: list[float]
    max_batch_tokens: int
    draft_width: int | None = None


@frozen
class SpsModel:
    """The ``sps`` cost model returned by the hook."""

    name: str = NAME

    def check_grid(self, points: Sequence[tuple[int, int]], draft_width: int) -> None:
        """Refuse a probe grid this model cannot fit, before any probing happens."""
        check_grid(points, draft_width, NAME)

    def fit(self, samples: Sequence[CostSample], draft_width: int) -> SpsFit:
        """Fit samples of one context interval."""
        return fit_sps(samples, draft_width)

    def load(self, params: Mapping[str, Any], draft_width: int) -> SpsFit:
        """Rebuild a fit from its saved params."""
        return SpsFit(draft_width, structure_params(params, SpsParams, NAME))

    def read_legacy(self, doc: Mapping[str, Any], source: str) -> tuple[dict[str, Any], int | None]:
        """Params of a legacy steps-per-second table and its draft width (None when it has none).

        Its samples cover any bucket, up to ``max_batch_tokens`` rows.
        """
        old = structure_checked(doc, LegacySpsDoc, source=source)
        params = {"target_rows": old.sample_batch_tokens, "steps_per_second": old.sample_steps_per_sec,
                  "request_buckets": None, "max_rows": old.max_batch_tokens}
        return params, old.draft_width


@hookimpl
def dspark_cost_model(name: str) -> SpsModel | None:
    """Provide the sps model under its name."""
    return SpsModel() if name == NAME else None


@hookimpl
def dspark_components() -> list[Component]:
    """Declare the sps cost model."""
    return [Component("cost_model", NAME, "one-dimensional steps-per-second table over target rows; cost = 1000/SPS(G) ms")]
