"""Additive full-step cost model: seconds = bias + alpha(Bcap) + theta(G).

``alpha`` depends only on the physical request bucket and ``theta`` only on the
target graph rows. The split between bias, alpha and theta is not unique, so
the fit pins ``alpha(smallest bucket) = 0`` and ``theta(smallest G) = 0``; the
remaining unknowns are then determined exactly when the bipartite graph of
probed (bucket, rows) points is connected through shared row counts.

The fit is also *monotone*: ``theta`` never falls as rows grow and ``alpha``
never falls as buckets grow. A step with more rows or more requests does more
work, so a dip is measurement noise, and an unconstrained fit hands that noise
straight to the budget policy, which then picks exactly the tier the noise made
look cheap (seen on the CPU: a bucket-4 tier priced 28 % under its wall time
because its theta came from a chain of other buckets' differences).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from attrs import field, frozen
from scipy.optimize import lsq_linear

from dspark_core.components import Component
from dspark_core.convert import float_tuple, int_tuple, structure_checked
from dspark_core.costs.base import (
    Coverage,
    check_draft_off_params,
    CostSample,
    check_grid,
    draft_off_seconds,
    drafting_samples,
    interpolate,
    pool_samples,
    spans_within,
    structure_params,
)
from dspark_core.errors import ConfigError
from dspark_core.geometry import full_width_rows
from dspark_core.hookspecs import hookimpl

NAME = "additive"


@frozen
class AdditiveParams:
    """Saved form: alpha per request bucket, theta per probed target-row count."""

    bias_seconds: float
    request_buckets: tuple[int, ...] = field(converter=int_tuple)
    alpha_seconds: tuple[float, ...] = field(converter=float_tuple)
    target_rows: tuple[int, ...] = field(converter=int_tuple)
    theta_seconds: tuple[float, ...] = field(converter=float_tuple)
    # draft-off steps have their own per-bucket term instead of alpha + theta (no draft,
    # Bcap rows); fitted as the pooled mean of their windows. Empty in older tables.
    draft_off_buckets: tuple[int, ...] = field(default=(), converter=int_tuple)
    draft_off_seconds: tuple[float, ...] = field(default=(), converter=float_tuple)


@frozen
class AdditiveFit:
    """A fitted additive surface for one context interval."""

    draft_width: int
    p: AdditiveParams
    model: str = NAME

    def __attrs_post_init__(self) -> None:
        p = self.p
        if len(p.alpha_seconds) != len(p.request_buckets) or not p.request_buckets:
            raise ConfigError("additive params: alpha_seconds needs one value per request bucket")
        if len(p.theta_seconds) != len(p.target_rows) or not p.target_rows:
            raise ConfigError("additive params: theta_seconds needs one value per target_rows entry")
        for name, values in (("request_buckets", p.request_buckets), ("target_rows", p.target_rows)):
            if list(values) != sorted(set(values)) or values[0] < 1:
                raise ConfigError(f"additive params: {name} must be positive, ascending and unique, got {list(values)}")
        check_draft_off_params(p.draft_off_buckets, p.draft_off_seconds, NAME)

    def predict_seconds(self, request_bucket: int, target_rows: int) -> float | None:
        """bias + alpha(bucket) + theta(rows), or None outside the fitted coverage."""
        p = self.p
        if request_bucket not in p.request_buckets:
            return None
        if not request_bucket <= target_rows <= full_width_rows(request_bucket, self.draft_width):
            return None
        theta = interpolate(p.target_rows, p.theta_seconds, target_rows)
        if theta is None:  # outside the probed row span: not covered
            return None
        return p.bias_seconds + p.alpha_seconds[p.request_buckets.index(request_bucket)] + theta

    def predict_draft_off_seconds(self, request_bucket: int) -> float | None:
        """The bucket's draft-off step cost, or None when it was not probed."""
        p = self.p
        if request_bucket not in p.draft_off_buckets:
            return None
        return p.draft_off_seconds[p.draft_off_buckets.index(request_bucket)]

    @property
    def coverage(self) -> Coverage:
        """Each fitted bucket, at its legal rows inside the probed theta span."""
        rows = self.p.target_rows
        return Coverage(spans_within(self.p.request_buckets, rows[0], rows[-1], self.draft_width),
                        draft_off_buckets=self.p.draft_off_buckets)

    @property
    def params(self) -> dict[str, Any]:
        p = self.p
        return {
            "bias_seconds": p.bias_seconds,
            "request_buckets": list(p.request_buckets),
            "alpha_seconds": list(p.alpha_seconds),
            "target_rows": list(p.target_rows),
            "theta_seconds": list(p.theta_seconds),
            "draft_off_buckets": list(p.draft_off_buckets),
            "draft_off_seconds": list(p.draft_off_seconds),
        }


def _connected_parts(points: Sequence[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    # Union-find over bucket nodes and row nodes; an edge per probed point.
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(node: tuple[str, int]) -> tuple[str, int]:
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for b, g in points:
        parent[find(("b", b))] = find(("g", g))
    groups: dict[tuple[str, int], tuple[set[int], set[int]]] = {}
    for kind, value in list(parent):
        buckets, rows = groups.setdefault(find((kind, value)), (set(), set()))
        (buckets if kind == "b" else rows).add(value)
    return sorted((sorted(b), sorted(g)) for b, g in groups.values())


def _check_connected(points: Sequence[tuple[int, int]]) -> None:
    parts = _connected_parts(points)
    if len(parts) > 1:
        described = "; ".join(
            f"part {i + 1}: buckets {b} with target rows {g}" for i, (b, g) in enumerate(parts)
        )
        raise ConfigError(
            f"additive: the probe grid is not connected through shared target-row values, so alpha and "
            f"theta cannot be separated ({described}). Probe at least one row count in two parts' buckets."
        )


def fit_additive(samples: Sequence[CostSample], draft_width: int) -> AdditiveFit:
    """Monotone least-squares fit of one interval's samples (each point weighted by its windows).

    The unknowns are the bias and the non-negative *steps* between neighbouring
    buckets' alphas and neighbouring rows' thetas, so the solution is
    non-decreasing in both by construction (a bounded linear least squares).
    """
    off = draft_off_seconds(samples)
    measured = pool_samples(drafting_samples(samples))
    points = [(m.request_bucket, m.target_rows) for m in measured]
    check_grid(points, draft_width, NAME)
    _check_connected(points)
    buckets = sorted({b for b, _ in points})
    rows = sorted({g for _, g in points})
    # Columns: bias, then the steps alpha[i] - alpha[i-1] for every bucket but the first and
    # theta[j] - theta[j-1] for every row but the first. A point at bucket i, rows j sums
    # the first i alpha steps and the first j theta steps.
    ncols = 1 + (len(buckets) - 1) + (len(rows) - 1)
    a = np.zeros((len(measured), ncols))
    y = np.empty(len(measured))
    w = np.empty(len(measured))
    for i, m in enumerate(measured):
        a[i, 0] = 1.0
        bi, gi = buckets.index(m.request_bucket), rows.index(m.target_rows)
        a[i, 1 : 1 + bi] = 1.0
        a[i, len(buckets) : len(buckets) + gi] = 1.0
        y[i] = m.step_seconds
        # relative weighting: the policy divides by these costs, so a 10 ms error matters far
        # more on a 100 ms step than on a 1 s one (this minimises relative, not absolute, error)
        w[i] = np.sqrt(m.windows) / m.step_seconds
    weighted = a * w[:, None]
    rank = np.linalg.matrix_rank(weighted)
    if rank < ncols:  # cannot happen on a connected grid; kept as a guard
        raise ConfigError(f"additive: the probe grid leaves {ncols - rank} parameter(s) undetermined")
    lower = np.r_[-np.inf, np.zeros(ncols - 1)]
    solution = lsq_linear(weighted, y * w, bounds=(lower, np.inf), method="bvls").x
    alpha = (0.0, *(float(v) for v in np.cumsum(solution[1 : len(buckets)])))
    theta = (0.0, *(float(v) for v in np.cumsum(solution[len(buckets) :])))
    fit = AdditiveFit(draft_width, AdditiveParams(float(solution[0]), buckets, alpha, rows, theta,
                                                  sorted(off), [off[b] for b in sorted(off)]))
    _check_positive(fit)
    return fit


def _check_positive(fit: AdditiveFit) -> None:
    # A noisy fit can place an unmeasured (bucket, rows) pair at or below zero;
    # the budget policy divides by cost, so refuse instead of serving that.
    for b in fit.p.request_buckets:
        for g in fit.p.target_rows:
            value = fit.predict_seconds(b, g)
            if value is not None and value <= 0:
                raise ConfigError(f"additive: the fit predicts {value:.3g} s at bucket {b}, {g} rows; the samples are too noisy")


@frozen
class LegacyAdditiveDoc:
    """An additive table from before tables named their model (other engines' DSpark file)."""

    bias_seconds: float
    bs_probes: list[int]
    alpha_seconds: list[float]
    m_probes: list[int]
    theta_seconds: list[float]
    draft_width: int | None = None


@frozen
class AdditiveModel:
    """The ``additive`` cost model returned by the hook."""

    name: str = NAME

    def check_grid(self, points: Sequence[tuple[int, int]], draft_width: int) -> None:
        """Refuse a probe grid this model cannot fit, before any probing happens."""
        check_grid(points, draft_width, NAME)
        _check_connected(points)

    def fit(self, samples: Sequence[CostSample], draft_width: int) -> AdditiveFit:
        """Fit samples of one context interval."""
        return fit_additive(samples, draft_width)

    def load(self, params: Mapping[str, Any], draft_width: int) -> AdditiveFit:
        """Rebuild a fit from its saved params."""
        return AdditiveFit(draft_width, structure_params(params, AdditiveParams, NAME))

    def read_legacy(self, doc: Mapping[str, Any], source: str) -> tuple[dict[str, Any], int | None]:
        """Params of a legacy additive table and its draft width (None when it has none).

        ``bs_probes`` are the request buckets of ``alpha_seconds``, ``m_probes``
        the target rows of ``theta_seconds``.
        """
        old = structure_checked(doc, LegacyAdditiveDoc, source=source)
        params = {"bias_seconds": old.bias_seconds, "request_buckets": old.bs_probes, "alpha_seconds": old.alpha_seconds,
                  "target_rows": old.m_probes, "theta_seconds": old.theta_seconds}
        return params, old.draft_width


@hookimpl
def dspark_cost_model(name: str) -> AdditiveModel | None:
    """Provide the additive model under its name."""
    return AdditiveModel() if name == NAME else None


@hookimpl
def dspark_components() -> list[Component]:
    """Declare the additive cost model."""
    return [Component("cost_model", NAME, "full-step seconds = bias + alpha(request bucket) + theta(target rows)")]
