"""The additive cost model: recovery, interpolation, coverage and grid refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from dspark_core.errors import ConfigError
from dspark_core.geometry import full_width_rows
from test_costs_support import LOOKUP, grid_samples, planted, simple_cost

ADDITIVE = LOOKUP("additive")


@st.composite
def planted_surfaces(draw):
    k = draw(st.sampled_from([5, 7]))
    buckets = draw(st.sampled_from([(1, 2), (1, 2, 4), (1, 2, 4, 8)]))
    rows = range(1, full_width_rows(buckets[-1], k) + 1)
    bias = draw(st.floats(0.005, 0.05))
    # Real steps never get cheaper with more requests or rows, and the fit assumes so:
    # draw non-negative steps (zero included: flat stretches are common on accelerators).
    alpha = dict(zip(buckets, _cumulative([0.0] + [draw(st.floats(0.0, 0.005)) for _ in buckets[1:]])))
    theta = dict(zip(rows, _cumulative([0.0] + [draw(st.floats(0.0, 0.002)) for _ in rows[1:]])))
    return k, buckets, bias, alpha, theta


def _cumulative(steps: list[float]) -> list[float]:
    total, out = 0.0, []
    for step in steps:
        total += step
        out.append(total)
    return out


@hsettings(max_examples=25, deadline=None)
@given(planted_surfaces(), st.integers(0, 2**32 - 1))
def test_planted_parameters_are_recovered_under_noise(surface, seed):
    k, buckets, bias, alpha, theta = surface
    import random

    rng = random.Random(seed)
    # +-0.1 % multiplicative noise per window.
    samples = grid_samples(planted(bias, alpha, theta), buckets, k, noise=lambda i: 1 + rng.uniform(-1e-3, 1e-3))
    fit = ADDITIVE.fit(samples, k)
    tol = 2e-3 * (bias + max(alpha.values()) + max(theta.values()))
    assert fit.p.bias_seconds == pytest.approx(bias, abs=tol)
    for b, a in zip(fit.p.request_buckets, fit.p.alpha_seconds):
        assert a == pytest.approx(alpha[b], abs=tol)
    for g, t in zip(fit.p.target_rows, fit.p.theta_seconds):
        assert t == pytest.approx(theta[g], abs=tol)


@hsettings(max_examples=25, deadline=None)
@given(planted_surfaces())
def test_noise_free_predictions_equal_measurements(surface):
    k, buckets, bias, alpha, theta = surface
    truth = planted(bias, alpha, theta)
    fit = ADDITIVE.fit(grid_samples(truth, buckets, k), k)
    for b in buckets:
        for g in range(b, full_width_rows(b, k) + 1):
            assert fit.predict_seconds(b, g) == pytest.approx(truth(b, g), rel=1e-9, abs=1e-12)


def test_identifiability_constraint_pins_smallest_bucket_and_rows():
    fit = ADDITIVE.fit(grid_samples(simple_cost, (1, 2, 4), 3), 3)
    assert fit.p.alpha_seconds[0] == 0.0 and fit.p.theta_seconds[0] == 0.0
    assert fit.p.bias_seconds == pytest.approx(0.010 + 0.001 + 0.0002)


def test_theta_is_interpolated_between_probed_rows():
    # Buckets 1 and 2 share rows 2 and 4 only; rows 3, 5..7 are never probed.
    rows = {1: (2, 4), 2: (2, 4, 8)}
    fit = ADDITIVE.fit(grid_samples(simple_cost, (1, 2), 3, rows=rows.get), 3)
    assert fit.p.target_rows == (2, 4, 8)
    assert fit.predict_seconds(2, 6) == pytest.approx(simple_cost(2, 6))
    assert fit.predict_seconds(1, 3) == pytest.approx(simple_cost(1, 3))


def test_points_outside_coverage_are_none():
    rows = {1: (2, 4), 2: (2, 4, 8)}
    fit = ADDITIVE.fit(grid_samples(simple_cost, (1, 2), 3, rows=rows.get), 3)
    assert fit.predict_seconds(1, 1) is None  # below the probed row span
    assert fit.predict_seconds(4, 8) is None  # bucket never probed
    assert fit.predict_seconds(1, 5) is None  # illegal for bucket 1 at K=3
    assert fit.predict_seconds(2, 8) is not None
    assert fit.coverage.covers(2, 8, 3) and not fit.coverage.covers(1, 1, 3)


def test_disconnected_grid_is_refused_naming_the_parts():
    # Full width only: bucket 1 at 4 rows and bucket 2 at 8 rows share nothing.
    rows = {1: (4,), 2: (8,), 4: (8, 16)}
    samples = grid_samples(simple_cost, (1, 2, 4), 3, rows=rows.get)
    with pytest.raises(ConfigError) as err:
        ADDITIVE.fit(samples, 3)
    text = str(err.value)
    assert "not connected" in text
    assert "part 1: buckets [1] with target rows [4]" in text
    assert "part 2: buckets [2, 4] with target rows [8, 16]" in text


def test_missing_full_width_tier_is_refused():
    rows = {1: (1, 2, 3, 4), 2: (2, 3, 4)}  # bucket 2 lacks 8 rows
    with pytest.raises(ConfigError, match="lacks full-width coverage; add bucket 2 at 8 rows"):
        ADDITIVE.fit(grid_samples(simple_cost, (1, 2), 3, rows=rows.get), 3)


def test_illegal_probe_rows_are_refused():
    rows = {1: (1, 4, 5)}
    with pytest.raises(ConfigError, match="bucket 1 was probed at 5 target rows, outside its legal range 1..4"):
        ADDITIVE.fit(grid_samples(simple_cost, (1,), 3, rows=rows.get), 3)


def test_params_round_trip_through_load():
    fit = ADDITIVE.fit(grid_samples(simple_cost, (1, 2), 3), 3)
    assert ADDITIVE.load(fit.params, 3) == fit


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"alpha_seconds": [0.0]}, "one value per request bucket"),
        ({"target_rows": [3, 2, 1, 4, 5, 6, 7, 8]}, "ascending"),
        ({"bias_seconds": "fast"}, r"@ \$.bias_seconds"),
        ({"extra": 1}, r"unknown key\(s\) \(extra\)"),
    ],
)
def test_bad_params_are_refused(change, message):
    params = dict(ADDITIVE.fit(grid_samples(simple_cost, (1, 2), 3), 3).params, **change)
    with pytest.raises(ConfigError, match=message):
        ADDITIVE.load(params, 3)


def test_fit_is_non_decreasing_in_rows_and_buckets_under_noise():
    # Windows that make 3 rows dearer than 4..6 and bucket 2 dearer than bucket 4: an
    # unconstrained fit would price those tiers below smaller ones, and the budget
    # policy would choose exactly them. The monotone fit pools them instead.
    measured = {(1, 1): 0.057, (1, 2): 0.062, (1, 3): 0.069, (1, 4): 0.067, (1, 5): 0.060, (1, 6): 0.058,
                (2, 2): 0.058, (2, 4): 0.072, (2, 6): 0.063, (2, 12): 0.085,
                (4, 4): 0.065, (4, 12): 0.090, (4, 24): 0.116}
    rows = {b: tuple(g for bb, g in measured if bb == b) for b in (1, 2, 4)}
    fit = ADDITIVE.fit(grid_samples(lambda b, g: measured[b, g], (1, 2, 4), 5, rows=rows.get), 5)
    assert list(fit.p.theta_seconds) == sorted(fit.p.theta_seconds)
    assert list(fit.p.alpha_seconds) == sorted(fit.p.alpha_seconds)
    for b in (1, 2, 4):
        costs = [fit.predict_seconds(b, g) for g in range(b, full_width_rows(b, 5) + 1)]
        assert all(c is not None for c in costs)
        assert costs == sorted(costs), f"bucket {b}: more rows priced cheaper: {costs}"
    # Pooling only moves a point as far as its neighbours' noise (these windows scatter by
    # about +-10 %, like the CPU table they were taken from), never further.
    for (b, g), seconds in measured.items():
        assert fit.predict_seconds(b, g) == pytest.approx(seconds, rel=0.11)
