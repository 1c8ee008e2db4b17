"""Confidence metrics (ROC-AUC, ECE, τ) on hand-checkable cases, and STS calibration."""

import json
import math

import numpy as np
import pytest

from dspark_core.train import sts


def test_roc_auc_hand_cases():
    assert sts.roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert sts.roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    # pairs (pos, neg): (0.8>0.2) (0.8<0.9) (0.3>0.2) (0.3<0.9) -> 2 of 4
    assert sts.roc_auc([0.8, 0.3, 0.2, 0.9], [1, 1, 0, 0]) == 0.5
    # a tie between a positive and a negative counts one half: 1 of 1 pair is tied
    assert sts.roc_auc([0.5, 0.5], [1, 0]) == 0.5
    # 3 positives, 1 negative: scores above / tied / below the negative -> (1 + 0.5 + 0) / 3
    assert sts.roc_auc([0.9, 0.4, 0.1, 0.4], [1, 1, 1, 0]) == pytest.approx(0.5)
    assert math.isnan(sts.roc_auc([0.1, 0.2], [1, 1]))


def test_ece_hand_cases():
    # all predictions 0.75 in one bin, 3 of 4 hit -> perfectly calibrated
    assert sts.ece([0.75] * 4, [1, 1, 1, 0], bins=10) == pytest.approx(0.0)
    # two bins: {0.2, 0.2} with outcomes {1, 1} -> gap 0.8; {0.9, 0.9} with {1, 0} -> gap 0.4
    assert sts.ece([0.2, 0.2, 0.9, 0.9], [1, 1, 1, 0], bins=10) == pytest.approx(0.5 * 0.8 + 0.5 * 0.4)
    assert sts.ece([1.0], [0], bins=5) == pytest.approx(1.0)  # p = 1.0 falls in the last bin


def test_survival_and_tau():
    hits = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=bool)
    s = sts.survival(hits)
    assert s.tolist() == [[True, True, False, False], [False, False, False, False], [True, True, True, True]]
    assert sts.tau_from_accepted([2, 0, 4]) == pytest.approx(3.0)  # (2+0+4)/3 accepted + 1 bonus
    p = sts.predicted_survival(np.zeros((1, 3)), [1.0, 1.0, 1.0])
    assert p[0].tolist() == pytest.approx([0.5, 0.25, 0.125])


def test_reached_auc_ignores_positions_after_a_miss():
    logits = np.array([[2.0, -5.0], [-2.0, 5.0], [1.0, 3.0], [-1.0, -3.0]])
    hits = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=bool)
    pooled, per = sts.reached_auc(logits, hits)
    assert per[0] == 1.0
    assert per[1] == 1.0  # only rows 0 and 2 reach position 1: -5 (miss) < 3 (hit)
    assert pooled == pytest.approx(1.0)


def synthetic_overconfident(n=4000, k=4, seed=0):
    """Logits that are 3x too sharp: the true hit probability is sigmoid(z / 3)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 2.5, size=(n, k)) * 3.0
    hits = rng.random((n, k)) < 1.0 / (1.0 + np.exp(-z / 3.0))
    return z, hits


def test_sts_reduces_survival_ece_and_recovers_the_temperature():
    z, hits = synthetic_overconfident()
    before = sts.survival_ece(z, hits, [1.0] * 4)
    temps = sts.fit_sts(z, hits)
    after = sts.survival_ece(z, hits, temps)
    assert all(a < b for a, b in zip(after, before))
    assert max(after) < 0.03 < min(before)
    assert temps[0] == pytest.approx(3.0, rel=0.25)


def test_sts_is_written_into_the_config(tmp_path):
    from dspark_core.models.random_models import random_draft, tiny_target_config
    from dspark_core.models.speculators_io import load_draft, save_draft

    draft = random_draft(tiny_target_config(), block_size=4)
    save_draft(draft, tmp_path / "d")
    z, hits = synthetic_overconfident()
    temps = sts.fit_sts(z, hits)
    sts.write_temperatures(tmp_path / "d", temps, output=tmp_path / "cal")
    assert "dspark_core" not in json.loads((tmp_path / "d" / "config.json").read_text())  # source untouched
    loaded = load_draft(tmp_path / "cal")
    assert loaded.config.sts_temperatures == pytest.approx(tuple(temps), rel=1e-5)
    conf = loaded.confidence(__import__("torch").full((1, 4), 2.0))
    assert conf[0, 0].item() == pytest.approx(1.0 / (1.0 + math.exp(-2.0 / temps[0])), rel=1e-5)


def test_offset_fixes_a_biased_head_that_temperatures_cannot():
    rng = np.random.default_rng(1)
    z = rng.normal(1.0, 1.5, size=(4000, 3))
    hits = rng.random(z.shape) < 1.0 / (1.0 + np.exp(-(z - 1.5)))  # the head is 1.5 logits too optimistic
    temps_only = sts.survival_ece(z, hits, sts.fit_sts(z, hits))
    shift, temps = sts.fit_sts_with_offset(z, hits)
    with_offset = sts.survival_ece(z + shift, hits, temps)
    assert shift == pytest.approx(-1.5, abs=0.5)
    assert max(with_offset) < 0.03 < temps_only[0]


def test_offset_is_folded_into_the_confidence_bias(tmp_path):
    import torch

    from dspark_core.models.random_models import random_draft, tiny_target_config
    from dspark_core.models.speculators_io import load_draft, save_draft

    draft = random_draft(tiny_target_config(), block_size=4)
    save_draft(draft, tmp_path)
    sts.add_confidence_offset(tmp_path, -0.75)
    loaded = load_draft(tmp_path)
    assert loaded.confidence_head.proj.bias.item() == pytest.approx(draft.confidence_head.proj.bias.item() - 0.75, abs=1e-6)
    assert torch.equal(loaded.confidence_head.proj.weight, draft.confidence_head.proj.weight)
