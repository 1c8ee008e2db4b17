"""The engine's public API for callers that steer it from outside: policy swaps, the device queue, device work.

Calibration probes, the benchmark and multi-rank workers use exactly these
methods; nothing outside ``dspark_core/engine`` touches the engine's private members.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.pipeline import DeviceQueue
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError, ModelError
from dspark_core.plugins import default_hooks
from engine_support import random_prompts, synthetic_table, tiny_pair

WIDTH, BUCKETS = 3, (1, 2)


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=3, block_size=WIDTH)


def _engine(models, policy="fixed", draft=True):
    target, d = models
    engine = Engine(target, d if draft else None, EngineConfig(draft_width=WIDTH, policy=policy, request_buckets=BUCKETS,
                                                               max_model_len=96))
    engine.install_table(synthetic_table(WIDTH, BUCKETS))
    return engine


def test_use_policy_swaps_for_the_block_and_restores_even_on_error(models):
    engine = _engine(models)
    original = engine.policy
    other = default_hooks().budget_policy("none", {})
    with engine.use_policy(other):
        assert engine.policy is other
    assert engine.policy is original
    with pytest.raises(RuntimeError), engine.use_policy(other):
        raise RuntimeError("probe failed")
    assert engine.policy is original
    engine.close()


def test_generate_tells_each_finished_request_as_it_ends(models):
    engine = _engine(models)
    seen = []
    outputs = engine.generate(random_prompts(5, seed=2), SamplingParams(max_tokens=4), finished=seen.append)
    assert len(seen) == 5 and {o.request_id for o in seen} == {o.request_id for o in outputs}
    engine.close()


def test_a_drafting_policy_needs_an_engine_with_a_draft(models):
    engine = _engine(models, policy="none", draft=False)
    with pytest.raises(ConfigError, match="needs a draft model"):
        engine.set_policy(default_hooks().budget_policy("fixed", {}))
    engine.close()


def test_replace_queue_routes_device_work_through_the_new_queue(models):
    engine = _engine(models)
    calls = []

    class CountingQueue(DeviceQueue):
        def submit(self, kind, requests, fn, *args, context=None):
            calls.append(kind)
            return super().submit(kind, requests, fn, *args, context=context)

    engine.replace_queue(CountingQueue(False))
    out = engine.generate(random_prompts(2, seed=5), SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]
    assert calls[0] == "prefill" and "decode" in calls
    engine.close()


def test_an_engine_whose_draft_was_bound_to_a_later_engine_refuses_to_propose(models):
    target, draft = models
    prompts = random_prompts(2, seed=7)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = _engine(models)
    assert [len(o.token_ids) for o in first.generate(prompts, params)] == [6, 6]
    second = _engine(models)  # the same draft instance: it now holds the second engine's context cache
    assert [len(o.token_ids) for o in second.generate(prompts, params)] == [6, 6]
    with pytest.raises(ModelError, match="bound to another engine built after it.*one draft instance per engine"):
        first.generate(prompts, params)
    first.close()
    # an engine without a draft is not affected, and one built later on the same draft works
    assert len(_engine(models, policy="none", draft=False).generate(prompts[:1], params)[0].token_ids) == 6
    second.close()
    third = _engine(models)
    assert [len(o.token_ids) for o in third.generate(prompts, params)] == [6, 6]
    third.close()


def test_no_caller_outside_the_engine_touches_its_private_members():
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\bengine\._[a-z]")
    offenders = [f"{p.relative_to(root)}:{n}" for d in ("dspark_core", "plugins") for p in (root / d).rglob("*.py")
                 if "engine" not in p.relative_to(root / d).parts[:1]
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert offenders == []
