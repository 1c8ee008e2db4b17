"""Adaptive verifies no more than the bucket's draft depth per request (unless ``verify_past_depth``).

At a bucket where ``--draft_depths`` cuts the draft's block, copy proposals still fill all K
positions, and a request verifying a long copy gets an attention band of its own that the cost
table does not price. The policy then fixes the split on the host, by the allocate kernel's rule,
with every cap cut to the depth.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.plugins import default_hooks
from dspark_core.policy import TierContext, host_allocate
from dspark_kernels.allocate import make_allocate
from engine_support import greedy_references, random_prompts, synthetic_table, tiny_pair

WIDTH = 7
BUCKETS = (1, 2, 4, 8, 16)
DEPTHS = ((4, 2), (8, 2), (16, 2))
MAX_TOKENS = 40


def test_the_host_split_is_the_allocate_kernels():
    kernel = make_allocate(WIDTH)
    rng = np.random.default_rng(0)
    for _ in range(300):
        batch = int(rng.integers(1, 17))
        confidences = rng.random((batch, WIDTH))
        confidences[rng.random((batch, WIDTH)) < 0.2] = 0.0
        if rng.random() < 0.5:  # ties between requests and positions
            confidences = np.round(confidences, 1)
        caps = rng.integers(-1, WIDTH + 1, size=batch)
        rows = int(rng.integers(0, batch * WIDTH + 3))
        expected = kernel(torch.tensor(confidences, dtype=torch.float32), torch.tensor(caps), rows).numpy()
        assert host_allocate(confidences, caps, rows).tolist() == expected.tolist()


def context(depth: int | None, *, bucket: int = 4) -> TierContext:
    tiers = tuple(bucket * j for j in range(1, WIDTH + 2))
    costs = np.array([0.1 + 0.004 * g for g in tiers])  # rows are cheap: long verifies pay by the table
    return TierContext(bucket, bucket, WIDTH, tiers, costs, draft_depth=depth)


# one request holds a confident seven-token copy; the draft's own two tokens are middling
CONFIDENCES = np.array([[0.99] * WIDTH] + [[0.6, 0.5] + [0.0] * (WIDTH - 2)] * 3)
CAPS = np.full(4, WIDTH)


def test_a_cut_bucket_verifies_within_its_depth():
    policy = default_hooks().budget_policy("adaptive", {})
    choice = policy.choose_tier(context(2), CONFIDENCES, CAPS)
    assert choice.lengths is not None and max(choice.lengths) == 2
    assert sum(choice.lengths) == choice.rows - 4  # every drafted row of the tier is spent
    # the table alone would verify the copy to its end
    past = default_hooks().budget_policy("adaptive", {"verify_past_depth": True})
    free = past.choose_tier(context(2), CONFIDENCES, CAPS)
    assert free.lengths is None and free.rows - 4 > 8  # more rows than four requests at depth 2 hold
    # a bucket proposing all K (or a context without depths) is not limited
    for depth in (None, WIDTH):
        whole = policy.choose_tier(context(depth), CONFIDENCES, CAPS)
        assert whole.lengths is None and whole.rows == free.rows


def test_a_copy_step_verifies_within_the_depth_too():
    policy = default_hooks().budget_policy("adaptive", {})
    ctx = TierContext(4, 4, WIDTH, context(2).tiers, context(2).tier_costs, draft_off_cost=0.2, draft_depth=2)
    choice = policy.choose_copy_tier(ctx, CONFIDENCES, CAPS)
    assert choice.copy_only and choice.lengths is not None and max(choice.lengths) <= 2
    free = default_hooks().budget_policy("adaptive", {"verify_past_depth": True}).choose_copy_tier(ctx, CONFIDENCES, CAPS)
    assert free.copy_only and free.lengths is None and free.rows > choice.rows


def test_the_option_is_off_by_default_and_checked():
    hooks = default_hooks()
    assert hooks.budget_policy("adaptive", {}).verify_past_depth is False
    assert hooks.budget_policy("adaptive", {"verify_past_depth": True}).verify_past_depth is True
    with pytest.raises(ConfigError, match="verify_past_depth must be true or false, got 1"):
        hooks.budget_policy("adaptive", {"verify_past_depth": 1})


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=11)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, seed=4)


def serve(models, prompts, options):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy="adaptive", policy_options=options,
                                                request_buckets=BUCKETS, max_model_len=160, schedule_overlap=True,
                                                copy_proposals="on", draft_depths=DEPTHS))
    engine.install_table(synthetic_table(WIDTH, BUCKETS, per_row=0.0005))  # rows cheap: long copies pay by the table
    reports = []
    engine.add_observer(reports.append)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    return [list(o.token_ids) for o in outputs], reports


def test_served_steps_keep_within_the_depth_and_stay_exact(models, prompts):
    references = greedy_references(models[0], prompts, MAX_TOKENS)
    limit = dict(DEPTHS)
    within, reports = serve(models, prompts, {})
    assert within == references
    cut = [r for r in reports if r.request_bucket in limit]
    assert cut and all(max(r.verify_lengths) <= limit[r.request_bucket] for r in cut)
    # the same serving with copies verified past the depth: the limit above is what held them back
    past, past_reports = serve(models, prompts, {"verify_past_depth": True})
    assert past == references
    assert any(max(r.verify_lengths) > limit[r.request_bucket] for r in past_reports if r.request_bucket in limit)
