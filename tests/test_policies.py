"""Budget policies: the adaptive choice is the optimum over captured tiers; fixed/none are exact widths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_core.errors import ConfigError, PluginError
from dspark_core.geometry import legal_tiers
from dspark_core.plugins import default_hooks
from dspark_core.policy import TierContext
from dspark_kernels import kernels_for


def brute_force_best_rate(conf, caps, bucket, tiers, costs):
    """Best (expected tokens / cost) over every per-request prefix allocation and every tier it fits."""
    surv = np.cumprod(conf, axis=1)
    best = -1.0
    for lengths in itertools.product(*[range(int(c) + 1) for c in caps]):
        rows = bucket + sum(lengths)
        expected = len(caps) + sum(surv[r, :n].sum() for r, n in enumerate(lengths))
        for tier, cost in zip(tiers, costs):
            if tier >= rows and np.isfinite(cost):
                best = max(best, expected / cost)
    return best


@st.composite
def case(draw):
    width = draw(st.sampled_from([2, 3, 5]))
    live = draw(st.integers(1, 3))
    bucket = draw(st.sampled_from([b for b in (1, 2, 4) if b >= live]))
    all_tiers = legal_tiers(bucket, width)
    subset = draw(st.lists(st.sampled_from(all_tiers), unique=True, max_size=len(all_tiers)))
    tiers = tuple(sorted(set(subset) | {all_tiers[-1]}))
    conf = np.array(draw(st.lists(st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]) | st.floats(0, 1),
                                  min_size=live * width, max_size=live * width))).reshape(live, width)
    caps = np.array(draw(st.lists(st.integers(0, width), min_size=live, max_size=live)))
    # a staircase-ish cost curve: bias plus per-row cost with random steps
    costs = np.array([1.0 + 0.05 * g + draw(st.sampled_from([0.0, 0.0, 0.3])) for g in tiers])
    return width, live, bucket, tiers, conf, caps, costs


@settings(max_examples=200, deadline=None)
@given(case())
def test_adaptive_choice_equals_brute_force_optimum(params):
    width, live, bucket, tiers, conf, caps, costs = params
    policy = default_hooks().budget_policy("adaptive", {})
    ctx = TierContext(bucket, live, width, tiers, costs)
    choice = policy.choose_tier(ctx, conf, caps)
    assert not choice.fallback and choice.rows in tiers
    # the device split with the same confidences realises the predicted score
    lengths = policy.split(kernels_for(width), torch.tensor(conf, dtype=torch.float32), torch.tensor(caps), choice,
                           bucket)
    assert bucket + int(lengths.sum()) <= choice.rows
    surv = np.cumprod(conf, axis=1)
    realised = live + sum(surv[r, : int(n)].sum() for r, n in enumerate(lengths))
    rate = realised / costs[tiers.index(choice.rows)]
    assert rate == pytest.approx(brute_force_best_rate(conf, caps, bucket, tiers, costs), rel=1e-5)


def test_full_scan_finds_a_tier_past_a_cost_drop():
    # rates: tier 2 better than 1, tier 3 worse, tier 4 best (a staircase); stopping early would miss it
    ctx = TierContext(1, 1, 3, (1, 2, 3, 4), np.array([1.0, 1.2, 2.5, 1.3]))
    choice = default_hooks().budget_policy("adaptive", {}).choose_tier(ctx, np.array([[0.9, 0.9, 0.9]]), np.array([3]))
    assert choice.rows == 4


def test_min_gain_keeps_full_width_unless_the_gain_is_large_enough():
    ctx = TierContext(1, 1, 2, (1, 2, 3), np.array([1.0, 1.0, 1.02]))
    conf, caps = np.array([[0.99, 0.01]]), np.array([2])
    hooks = default_hooks()
    assert hooks.budget_policy("adaptive", {}).choose_tier(ctx, conf, caps).rows == 2
    assert hooks.budget_policy("adaptive", {"min_gain": 0.04}).choose_tier(ctx, conf, caps).rows == 3


def test_missing_profile_falls_back_to_full_width():
    policy = default_hooks().budget_policy("adaptive", {})
    uncovered = TierContext(2, 2, 5, legal_tiers(2, 5), None)
    choice = policy.choose_tier(uncovered, np.ones((2, 5)), np.array([5, 5]))
    assert choice.fallback and choice.rows == 12
    partial = TierContext(1, 1, 2, (1, 2, 3), np.array([1.0, 1.0, np.nan]))  # full width itself not covered
    assert policy.choose_tier(partial, np.ones((1, 2)), np.array([2])).fallback


@pytest.mark.parametrize("k,expected", [(0, [0, 0, 0]), (2, [2, 2, 1]), (None, [5, 3, 1])])
def test_fixed_policy_verifies_k(k, expected):
    policy = default_hooks().budget_policy("fixed", {} if k is None else {"k": k})
    caps = torch.tensor([5, 3, 1])
    ctx = TierContext(4, 3, 5, legal_tiers(4, 5), None)
    choice = policy.choose_tier(ctx, np.ones((3, 5)), caps.numpy())
    lengths = policy.split(kernels_for(5), torch.ones(3, 5), caps, choice, 4)
    assert lengths.tolist() == expected
    assert choice.rows == 4 + sum(expected)


def test_none_policy_runs_no_draft():
    policy = default_hooks().budget_policy("none", {})
    assert policy.uses_draft is False
    assert policy.choose_tier(TierContext(4, 3, 5, legal_tiers(4, 5), None), np.ones((3, 5)), np.ones(3)).rows == 4


@pytest.mark.parametrize("name,options,match", [
    ("adaptive", {"bogus": 1}, r"unknown option\(s\) \['bogus'\]"),
    ("adaptive", {"tier_lag": 3}, "tier_lag must be 0, 1 or 2"),
    ("fixed", {"k": -1}, "k must be an integer >= 0"),
    ("none", {"k": 1}, "takes no options"),
])
def test_bad_policy_options(name, options, match):
    with pytest.raises(ConfigError, match=match):
        default_hooks().budget_policy(name, options)


def test_unknown_policy_lists_available():
    with pytest.raises(PluginError, match=r"no budget policy named 'greedy-ish' \(available: adaptive, argmax-notier, fixed, min-gain, none, stale-argmax, threshold\)"):
        default_hooks().budget_policy("greedy-ish")


def test_adaptive_ties_go_to_the_smaller_tier():
    # K=3, bucket 1: one sure token then none, so tiers 2, 3 and 4 all expect 2 tokens; with equal costs
    # tiers 2 and 3 tie on rate (and both beat full width 4), tier 1 expects 1
    policy = default_hooks().budget_policy("adaptive", {})
    conf, caps = np.array([[1.0, 0.0, 0.0]]), np.array([3])
    ctx = TierContext(1, 1, 3, (1, 2, 3, 4), np.array([1.0, 1.0, 1.0, 1.5]))
    # expected tokens 1, 2, 2, 2 over costs 1, 1, 1, 1.5: rates 1, 2, 2, 1.33 (an exact tie, not a near one)
    assert policy.choose_tier(ctx, conf, caps).rows == 2
    # a tie with the full-width tier also goes to the smaller one
    ctx = TierContext(1, 1, 3, (1, 2, 3, 4), np.array([1.0, 1.0, 1.0, 1.0]))
    assert policy.choose_tier(ctx, conf, caps).rows == 2


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.sampled_from([5, 7]), st.data())
def test_the_small_and_large_survival_paths_agree_exactly(requests, width, data):
    # the policy sums small blocks in plain Python and large ones with numpy; a tier choice must not
    # depend on which ran, so both must give the same float64 values, not merely close ones
    import dspark_core.policy as policy_module

    conf = np.array(data.draw(st.lists(st.floats(0, 1), min_size=requests * width, max_size=requests * width)),
                    dtype=data.draw(st.sampled_from([np.float32, np.float64]))).reshape(requests, width)
    caps = np.array(data.draw(st.lists(st.integers(-1, width), min_size=requests, max_size=requests)))
    small, large = policy_module.SMALL_BLOCK, 0
    try:
        policy_module.SMALL_BLOCK = 10**9
        by_python = policy_module.sorted_survival_prefix(conf, caps)
        policy_module.SMALL_BLOCK = large
        by_numpy = policy_module.sorted_survival_prefix(conf, caps)
    finally:
        policy_module.SMALL_BLOCK = small
    assert by_python.dtype == by_numpy.dtype == np.float64
    assert by_python.tolist() == by_numpy.tolist()
    assert len(by_python) == 1 + sum(min(max(int(c), 0), width) for c in caps)


def numpy_tier_scores(ctx, confidences, caps):
    """The rule of tier_scores written with whole-array numpy operations (its form until 2026-12-03)."""
    surv = np.cumprod(np.asarray(confidences, dtype=np.float64), axis=1)
    allowed = np.arange(surv.shape[1])[None, :] < np.asarray(caps)[:, None]
    gains = np.concatenate([[0.0], np.cumsum(np.sort(surv[allowed])[::-1])])
    draft_rows = np.minimum(np.asarray(ctx.tiers) - ctx.request_bucket, len(gains) - 1)
    expected = ctx.live_requests + np.minimum(ctx.forecast_scale * gains[draft_rows], draft_rows)
    return expected, expected / ctx.tier_costs


@settings(max_examples=150, deadline=None)
@given(case(), st.floats(0.05, 2.0), st.data())
def test_tier_scores_equal_the_whole_array_form_exactly(params, scale, data):
    width, live, bucket, tiers, conf, caps, costs = params
    costs = costs.copy()
    costs[:-1][np.array(data.draw(st.lists(st.booleans(), min_size=len(costs) - 1, max_size=len(costs) - 1)),
                        dtype=bool)] = np.nan  # uncovered tiers
    ctx = TierContext(bucket, live, width, tiers, costs, forecast_scale=scale)
    from dspark_core.policy import tier_scores

    expected, rate = tier_scores(ctx, conf, caps)
    want_expected, want_rate = numpy_tier_scores(ctx, conf, caps)
    assert expected.tolist() == want_expected.tolist()
    np.testing.assert_array_equal(rate, want_rate)  # NaN where NaN, bit-equal elsewhere


def test_adaptive_skips_uncovered_tiers_and_takes_the_best_covered_one():
    # expected tokens 1, 1.9, 2.71, 3.439: at these costs tier 3 would be the best (2.71 / 1.3), but it
    # has no calibrated cost (NaN), so the best covered tier wins (rates 1, 1.58, -, 1.38)
    policy = default_hooks().budget_policy("adaptive", {})
    conf, caps = np.array([[0.9, 0.9, 0.9]]), np.array([3])
    ctx = TierContext(1, 1, 3, (1, 2, 3, 4), np.array([1.0, 1.2, 1.3, 2.5]))
    assert policy.choose_tier(ctx, conf, caps).rows == 3
    ctx = TierContext(1, 1, 3, (1, 2, 3, 4), np.array([1.0, 1.2, np.nan, 2.5]))
    assert policy.choose_tier(ctx, conf, caps).rows == 2
    ctx = TierContext(1, 1, 3, (1, 2, 3, 4), np.array([np.nan, np.nan, np.nan, 2.0]))
    assert policy.choose_tier(ctx, conf, caps).rows == 4
