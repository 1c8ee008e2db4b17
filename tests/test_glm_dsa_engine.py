"""Speculative decoding over the GLM-DSA target is token-identical to target-only greedy decoding
(adaptive with an installed cost table, and fixed width; synchronous and with schedule overlap)."""

from __future__ import annotations

import pytest
import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.models.glm_dsa.tiny import draft_shape_config, random_glm_dsa_target, tiny_glm_dsa_config
from dspark_core.models.random_models import random_draft
from engine_support import OracleDraft, greedy_references, random_prompts, synthetic_table

MAX_TOKENS = 16
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def models():
    # index_topk=6 is below most context lengths here: the sparse selection is really exercised
    cfg = tiny_glm_dsa_config(index_topk=6)
    target = random_glm_dsa_target(cfg, seed=2, dtype=torch.float64)
    draft = random_draft(draft_shape_config(cfg), seed=2, block_size=7).to(torch.float64)
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, seed=11)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, MAX_TOKENS)


def run(target, draft, prompts, width, policy, options, *, overlap):
    config = EngineConfig(draft_width=width, policy=policy, policy_options=options, request_buckets=BUCKETS,
                          max_model_len=96, schedule_overlap=overlap)
    engine = Engine(target, draft, config)
    engine.install_table(synthetic_table(width, BUCKETS))
    if isinstance(draft, OracleDraft):
        draft.engine = engine
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    return engine, outputs


CASES = [("adaptive", {}, 7), ("fixed", {}, 5), ("fixed", {"k": 3}, 7)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy,options,width", CASES, ids=str)
def test_random_draft_is_exact(models, prompts, references, policy, options, width, overlap):
    target, draft = models
    engine, outputs = run(target, draft, prompts, width, policy, options, overlap=overlap)
    assert [list(o.token_ids) for o in outputs] == references
    assert engine.counters.committed_tokens == MAX_TOKENS * len(prompts)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy,options,width", CASES, ids=str)
def test_accepting_draft_is_exact_and_accepts(models, prompts, references, policy, options, width, overlap):
    target, draft = models
    oracle = OracleDraft(draft, {tuple(p): r for p, r in zip(prompts, references)}, seed=width)
    engine, outputs = run(target, oracle, prompts, width, policy, options, overlap=overlap)
    assert [list(o.token_ids) for o in outputs] == references
    assert sum(o.accepted_length for o in outputs) / len(outputs) > 1.5  # multi-token verify rows really ran


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_static_shape_target_is_exact(models, prompts, references, overlap):
    """The same run with the target pinned to the graph-capture (static-shape) forward."""
    target, draft = models
    oracle = OracleDraft(draft, {tuple(p): r for p, r in zip(prompts, references)}, seed=3)
    target.static_shapes = True
    try:
        engine, outputs = run(target, oracle, prompts, 7, "adaptive", {}, overlap=overlap)
    finally:
        target.static_shapes = False
    assert [list(o.token_ids) for o in outputs] == references
