"""Captured geometry: legal tiers, buckets and the full-width rule."""

import pytest

from dspark_core.errors import ConfigError
from dspark_core.geometry import Geometry, default_request_buckets, full_width_rows, legal_tiers


def test_legal_tiers_span_anchor_only_to_full_width():
    assert legal_tiers(2, 5) == tuple(range(2, 13))
    assert full_width_rows(4, 7) == 32


def test_default_buckets():
    assert default_request_buckets(16) == (1, 2, 4, 8, 16)
    assert default_request_buckets(12) == (1, 2, 4, 8, 12)
    assert default_request_buckets(16, 4) == (1, 2, 4)


def test_bucket_for_picks_the_smallest_fit():
    g = Geometry.all_tiers(7, (1, 2, 4, 8))
    assert [g.bucket_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_full_width_must_be_captured():
    with pytest.raises(ConfigError, match="full-width tier 16 must be captured"):
        Geometry(7, (2,), {2: (2, 4, 8)})


def test_rows_outside_the_legal_range_are_refused():
    with pytest.raises(ConfigError, match=r"target rows \[40\] outside legal range 4..32"):
        Geometry(7, (4,), {4: (4, 32, 40)})


def test_bucket_multiples_capture_one_tier_per_average_verify_length():
    g = Geometry.bucket_multiples(5, (1, 4))
    assert g.rows_for(4) == (4, 8, 12, 16, 20, 24)
    assert g.rows_for(1) == legal_tiers(1, 5)
