"""benchmarks/draft_difficulty.py: binning by the target's certainty and the copy (prompt-lookup) study."""

from __future__ import annotations

import numpy as np
import pytest
from script_support import load_script


@pytest.fixture(scope="module")
def dd():
    return load_script("draft_difficulty")


def test_the_continuation_comes_from_the_latest_match_and_never_looks_ahead(dd):
    tokens = [5, 1, 2, 7, 1, 2, 8, 9, 1, 2]
    assert dd.last_match_continuation(tokens, 9, 2, 3) == [8, 9, 1]  # latest [1, 2] is at 4..5, not 1..2
    assert dd.last_match_continuation(tokens, 5, 2, 3) == [7, 1, 2]
    assert dd.last_match_continuation(tokens, 2, 2, 3) is None  # [1, 2] first seen at 1..2
    # the continuation stops at the anchor: tokens after p are not written yet
    assert dd.last_match_continuation([3, 4, 3], 2, 1, 5) == [4, 3]
    assert dd.accepted([1, 2, 3], [1, 2, 4]) == 2 and dd.accepted([], [1]) == 0


def test_copy_study_counts_copies_and_falls_back_to_the_draft(dd):
    # one answer: prompt [1, 2, 3], then 1, 2, 3, 1, 2, 3 (a loop the copy proposer predicts exactly)
    tokens, first, width = [1, 2, 3, 1, 2, 3, 1, 2, 3], 3, 2
    anchors = list(range(first, len(tokens) - width))  # 3, 4, 5, 6
    hits = np.zeros((len(anchors), width), dtype=bool)  # a draft that never hits
    report = dd.copy_study([(tokens, first)], hits, width, order=2)
    assert report["anchors"] == 4 and report["draft"] == {"tau": 1.0, "acc1": 0.0}
    # anchor 3 ([3, 1] unseen before) falls back to the draft; 4, 5, 6 copy both tokens right
    assert report["matched_share"] == 0.75 and report["copy_first_token_precision"] == 1.0
    assert report["copy_else_draft"] == {"tau": 1 + 6 / 4, "acc1": 0.75}
    with pytest.raises(AssertionError, match="out of step"):
        dd.copy_study([(tokens, first)], hits[:3], width)


def test_bins_hold_every_anchor_once(dd):
    top1 = np.array([0.1, 0.5, 0.95, 1.0, 0.85])
    top2 = np.array([0.05, 0.4, 0.01, 0.0, 0.1])
    hits = np.array([False, True, True, True, False])
    report = dd.analyse(top1, top2, hits)
    assert sum(b["anchors"] for b in report["by_target_top1"]) == 5
    assert sum(b["anchors"] for b in report["by_target_lead"]) == 5
    last = report["by_target_top1"][-1]
    assert (last["from"], last["to"], last["anchors"], last["acc1"]) == (0.9, 1.0, 2, 1.0)
