"""The sps cost model: steps-per-second table over target rows, cost = 1000/SPS(G) ms."""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from dspark_core.costs import CostSample
from dspark_core.errors import ConfigError
from test_costs_support import LOOKUP, grid_samples, simple_cost

SPS = LOOKUP("sps")


@hsettings(max_examples=40, deadline=None)
@given(st.lists(st.floats(5.0, 500.0), min_size=8, max_size=8), st.sampled_from([(1, 2), (2,)]))
def test_cost_is_the_inverse_of_steps_per_second(rates, buckets):
    # K=3, rows 1..8; one window per row at the planted rate.
    samples = [CostSample(b, g, 0, 32 / rates[g - 1], 32) for b in buckets for g in range(b, 4 * b + 1)]
    fit = SPS.fit(samples, 3)
    for b in buckets:
        for g in range(b, 4 * b + 1):
            sps = fit.steps_per_second(g)
            assert sps == pytest.approx(rates[g - 1], rel=1e-9)
            assert fit.predict_seconds(b, g) * sps == pytest.approx(1.0, rel=1e-12)
            assert fit.predict_ms(b, g) == pytest.approx(1000.0 / sps, rel=1e-12)


def test_windows_are_pooled_as_total_steps_over_total_seconds():
    samples = [CostSample(1, 1, 0, 1.0, 10), CostSample(1, 1, 0, 3.0, 10), CostSample(1, 4, 0, 2.0, 10)]
    fit = SPS.fit(samples, 3)
    assert fit.steps_per_second(1) == pytest.approx(20 / 4.0)  # not the mean of 10 and 3.33
    assert fit.steps_per_second(4) == pytest.approx(5.0)


def test_steps_per_second_is_interpolated_and_not_extrapolated():
    samples = [CostSample(1, 1, 0, 1.0, 10), CostSample(1, 4, 0, 2.0, 10), CostSample(2, 8, 0, 4.0, 10)]
    fit = SPS.fit(samples, 3)
    assert fit.steps_per_second(2) == pytest.approx(10 + (5 - 10) / 3)
    assert fit.predict_seconds(2, 6) == pytest.approx(1 / (5 + (2.5 - 5) / 2))
    assert fit.predict_seconds(4, 8) is None  # bucket 4 was never probed
    assert fit.predict_seconds(1, 5) is None  # illegal for bucket 1 at K=3
    assert fit.coverage.buckets() == (1, 2)


def test_legacy_style_table_covers_every_bucket_up_to_max_rows():
    fit = SPS.load({"target_rows": [1, 8, 16], "steps_per_second": [100.0, 80.0, 50.0], "request_buckets": None,
                    "max_rows": 12}, 7)
    assert fit.predict_seconds(2, 8) == pytest.approx(1 / 80.0)
    assert fit.predict_seconds(1, 8) == pytest.approx(1 / 80.0)
    assert fit.predict_seconds(2, 13) is None  # beyond max_rows
    assert fit.coverage.any_bucket == (1, 12)


def test_missing_full_width_tier_is_refused():
    with pytest.raises(ConfigError, match="sps: the probe grid lacks full-width coverage; add bucket 2 at 8 rows"):
        SPS.fit([CostSample(2, 4, 0, 1.0, 10), CostSample(1, 4, 0, 1.0, 10)], 3)


def test_params_round_trip_through_load():
    fit = SPS.fit(grid_samples(simple_cost, (1, 2), 3), 3)
    assert SPS.load(fit.params, 3) == fit


def test_non_positive_rates_are_refused():
    with pytest.raises(ConfigError, match="steps_per_second must be > 0"):
        SPS.load({"target_rows": [1, 2], "steps_per_second": [1.0, 0.0]}, 3)
