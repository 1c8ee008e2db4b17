"""benchmarks/copy_calibration.py: fitted copy confidences set against measured acceptance."""

from __future__ import annotations

import pytest
from script_support import load_script

from dspark_core.train.copies import copy_acceptance


@pytest.fixture(scope="module")
def cc():
    return load_script("copy_calibration")


def test_expected_over_realized_copied_tokens(cc):
    # prompt [1, 2, 3, 9], answer 1 2 3 9 1 2 4: the key [1, 2] recurs (copies "3 9 ..."), right twice
    # then wrong once
    measured = copy_acceptance([([1, 2, 3, 9], [1, 2, 3, 9, 1, 2, 4])], (2,), 2)
    report = cc.compare([[0.5, 0.5]], measured)
    row = report["orders"][0]
    assert row["copies"] == sum(measured["copied"]) and row["copies"] > 0
    realized = sum(measured["hits"][0])
    assert row["expected_per_copy"] == pytest.approx(0.5 + 0.25)
    assert row["realized_per_copy"] == pytest.approx(realized / row["copies"], abs=1e-3)
    assert report["predicted_over_realized"] == pytest.approx(0.75 * row["copies"] / realized, abs=1e-3)
    # fitted confidences of 1 against copies that are sometimes wrong: over-priced
    assert cc.compare([[1.0, 1.0]], measured)["predicted_over_realized"] > 1.0


def test_no_copy_accepted_reads_nan_not_a_crash(cc):
    measured = copy_acceptance([([5, 6], [7, 8])], (2,), 2)
    report = cc.compare([[0.9, 0.9]], measured)
    assert report["orders"][0]["realized_per_copy"] is None
    assert report["predicted_over_realized"] != report["predicted_over_realized"]  # NaN
