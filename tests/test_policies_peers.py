"""Peer budget rules: their decisions, and that they are exact like every policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.geometry import legal_tiers
from dspark_core.plugins import default_hooks
from dspark_core.policy import TierContext
from dspark_kernels import kernels_for
from engine_support import OracleDraft, greedy_references, random_prompts, synthetic_table, tiny_pair

HOOKS = default_hooks()


def test_threshold_stops_where_survival_drops_below_h():
    policy = HOOKS.budget_policy("threshold", {"h": 0.5})
    conf = np.array([[0.9, 0.9, 0.5, 0.9], [0.4, 1.0, 1.0, 1.0]])  # survival .9 .81 .405 / .4 ...
    caps = np.array([4, 4])
    ctx = TierContext(2, 2, 4, legal_tiers(2, 4), None)
    choice = policy.choose_tier(ctx, conf, caps)
    assert choice.rows == 2 + 2
    lengths = policy.split(kernels_for(4), torch.tensor(conf, dtype=torch.float32), torch.tensor(caps), choice, 2)
    assert lengths.tolist() == [2, 0]


def test_argmax_notier_asks_for_rows_and_wastes_tier_padding():
    # captured tiers 1, 4, 8 (K=7, bucket 1); interpolated costs make 2 drafted tokens the best count
    ctx = TierContext(1, 1, 7, (1, 4, 8), np.array([1.0, 1.6, 3.0]))
    conf = np.array([[0.95, 0.95, 0.2, 0.2, 0.2, 0.2, 0.2]])
    choice = HOOKS.budget_policy("argmax-notier", {}).choose_tier(ctx, conf, np.array([7]))
    assert choice.draft_rows == 2 and choice.rows == 4  # runs tier 4 but only verifies 2
    lengths = HOOKS.budget_policy("argmax-notier", {}).split(kernels_for(7), torch.tensor(conf, dtype=torch.float32),
                                                             torch.tensor([7]), choice, 1)
    assert lengths.tolist() == [2]


def test_stale_argmax_fixes_the_split_on_the_host():
    policy = HOOKS.budget_policy("stale-argmax", {})
    assert policy.tier_lag == 1
    ctx = TierContext(2, 2, 3, legal_tiers(2, 3), np.linspace(1.0, 1.5, len(legal_tiers(2, 3))))
    stale = np.array([[0.9, 0.9, 0.9], [0.1, 0.1, 0.1]])
    choice = policy.choose_tier(ctx, stale, np.array([3, 3]))
    assert choice.lengths is not None and sum(choice.lengths) == choice.rows - 2
    # the current confidences (reversed) do not change a stale split
    current = torch.tensor([[0.1, 0.1, 0.1], [0.9, 0.9, 0.9]])
    assert policy.split(kernels_for(3), current, torch.tensor([3, 3]), choice, 2).tolist() == list(choice.lengths)


def test_min_gain_is_the_adaptive_rule_with_a_guard():
    policy = HOOKS.budget_policy("min-gain", {})
    assert policy.name == "min-gain" and policy.min_gain == pytest.approx(0.04)


@pytest.mark.parametrize("name,options,match", [
    ("threshold", {"h": 2}, r"h must be in \[0, 1\]"),
    ("stale-argmax", {"x": 1}, r"unknown option\(s\) \['x'\]"),
])
def test_bad_peer_options(name, options, match):
    with pytest.raises(ConfigError, match=match):
        HOOKS.budget_policy(name, options)


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=21)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("name", ["threshold", "argmax-notier", "stale-argmax", "min-gain"])
def test_peers_are_exact(models, name, overlap):
    target, draft = models
    prompts = random_prompts(10, seed=8)
    references = greedy_references(target, prompts, 16)
    oracle = OracleDraft(draft, {tuple(p): r for p, r in zip(prompts, references)}, seed=3)
    engine = Engine(target, oracle, EngineConfig(draft_width=5, policy=name, request_buckets=(1, 2, 4, 8),
                                                 max_model_len=160, schedule_overlap=overlap))
    oracle.engine = engine
    engine.install_table(synthetic_table(5, (1, 2, 4, 8)))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    engine.close()
    assert [list(o.token_ids) for o in outputs] == references
    assert sum(o.accepted_length for o in outputs) / len(outputs) > 1.3
