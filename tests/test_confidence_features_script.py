"""benchmarks/confidence_features.py: the pieces that turn records into its report."""

from __future__ import annotations

import numpy as np
import pytest
from script_support import load_script

script = load_script("confidence_features")


def test_auc_is_the_share_of_pairs_ranked_right_with_ties_counted_half():
    labels = np.array([True, True, False, False])
    assert script.auc(np.array([0.9, 0.8, 0.2, 0.1]), labels) == 1.0
    assert script.auc(np.array([0.1, 0.2, 0.8, 0.9]), labels) == 0.0
    assert script.auc(np.array([0.9, 0.2, 0.5, 0.1]), labels) == 0.75  # 3 of the 4 pairs
    assert script.auc(np.ones(4), labels) == 0.5


def test_the_logistic_fit_recovers_a_known_rule():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 2))
    y = (rng.random(20_000) < 1 / (1 + np.exp(-(2.0 * x[:, 0] - 0.5)))).astype(float)  # the second input is noise
    w = script.fit_logistic(x, y, l2=0.0)
    assert w[0] == pytest.approx(2.0, abs=0.1) and abs(w[1]) < 0.1 and w[2] == pytest.approx(-0.5, abs=0.1)


def _records(n=600, width=3, seed=1):
    """Anchors whose acceptance follows the ``informative`` column: a draft statistic that knows more
    than the head's logit (which is noise)."""
    rng = np.random.default_rng(seed)
    informative = rng.normal(size=(n, width))
    hits = rng.random((n, width)) < 1 / (1 + np.exp(-3 * informative))
    return {"logit": rng.normal(size=(n, width)), "logpmax": informative, "margin": rng.normal(size=(n, width)),
            "entropy": rng.normal(size=(n, width)), "hit": hits, "answer": np.arange(n) // 10}


def test_cross_fitted_models_find_the_informative_input_out_of_fold():
    data = _records()
    folds = np.array_split(np.unique(data["answer"]), 2)
    head = script.cross_fitted(data, script.INPUTS["head"], folds)
    both = script.cross_fitted(data, script.INPUTS["head+draft"], folds)
    assert head.shape == both.shape == data["hit"].shape and ((both > 0) & (both < 1)).all()
    first = data["hit"][:, 0]
    assert script.auc(both[:, 0], first) > 0.8 > 0.6 > script.auc(head[:, 0], first)


def test_the_split_yield_ranks_oracle_over_informed_over_blind():
    data = _records(n=2000)
    hits = data["hit"]
    folds = np.array_split(np.unique(data["answer"]), 2)
    informed = script.cross_fitted(data, script.INPUTS["head+draft"], folds)
    blind = np.full(hits.shape, 0.5)
    yields = [script.split_yield(p, hits, 8, 8, 300, seed=0) for p in (hits.astype(float), informed, blind)]
    assert yields[0] > yields[1] > yields[2] > 0
    assert yields[0] <= 1.0
