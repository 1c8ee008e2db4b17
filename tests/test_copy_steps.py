"""Copy steps: a draft-off step that still verifies the copies the request's own text offers."""

from __future__ import annotations

import numpy as np
import pytest
from attrs import frozen

from capture_support import StandInCapturedBackend

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.plugins import default_hooks
from dspark_core.policy import StepPlan, TierContext, copy_step_choice
from dspark_plugins.policies.adaptive import AdaptivePolicy
from engine_support import DraftDouble, draft_off_table, greedy_references, random_prompts, tiny_pair

WIDTH = 7
BUCKETS = (1, 2, 4, 8)
MAX_TOKENS = 40


def context(costs, *, bucket=4, live=4, off=0.05, tiers=(4, 8, 12, 16)) -> TierContext:
    return TierContext(bucket, live, WIDTH, tiers, np.array(costs, dtype=np.float64), off)


# -- the choice -----------------------------------------------------------------------------

def test_no_copy_found_is_a_draft_off_step():
    ctx = context([0.06, 0.07, 0.08, 0.09])
    choice = copy_step_choice(ctx, np.zeros((4, WIDTH)), np.full(4, WIDTH))
    assert choice.draft_off and not choice.copy_only and choice.rows == 4


def test_confident_copies_buy_the_tier_with_the_best_rate():
    ctx = context([0.06, 0.07, 0.08, 0.09])
    confidences = np.zeros((4, WIDTH))
    confidences[1] = 0.9  # one request found a copy: survivals 0.9, 0.81, ...
    choice = copy_step_choice(ctx, confidences, np.full(4, WIDTH))
    survival = np.cumprod(np.full(WIDTH, 0.9))
    # per second: draft-off 4 / 0.05 = 80; tier 8 (the 4 best survivals) 7.44 / 0.07 = 106.3;
    # tier 12 (all 7) 8.70 / 0.08 = 108.7; tier 16 (no more to verify) 8.70 / 0.09 = 96.6
    assert choice.copy_only and not choice.draft_off and choice.rows == 12
    assert choice.predicted_tokens == pytest.approx(4 + survival.sum())
    assert choice.predicted_seconds == pytest.approx(0.08)


def test_copies_that_do_not_pay_their_rows_leave_the_draft_off_step():
    # the same copy with every drafted tier at 120 ms: 8.70 / 0.12 = 72.5 tokens/s, draft-off 4 / 0.05 = 80
    choice = copy_step_choice(context([0.12, 0.12, 0.12, 0.12]), np.pad(np.full((1, WIDTH), 0.9), ((1, 2), (0, 0))),
                              np.full(4, WIDTH))
    assert choice.draft_off


def test_caps_limit_what_a_copy_step_verifies_and_uncovered_tiers_are_skipped():
    confidences = np.full((4, WIDTH), 0.99)
    # nothing may be verified: the draft-off step, however cheap the rows
    assert copy_step_choice(context([0.05, 0.05, 0.05, 0.05]), confidences, np.zeros(4, dtype=int)).draft_off
    # only tier 16 would pay, and it is not covered
    ctx = context([np.nan, 0.2, 0.2, np.nan])
    assert copy_step_choice(ctx, confidences, np.full(4, WIDTH)).draft_off
    assert copy_step_choice(context([0.06, 0.07, 0.08, 0.09], off=None), confidences, np.full(4, WIDTH)).draft_off


def test_the_option_is_on_by_default_and_checked():
    hooks = default_hooks()
    assert hooks.budget_policy("adaptive", {}).copy_steps is True
    assert hooks.budget_policy("adaptive", {"copy_steps": False}).copy_steps is False
    with pytest.raises(ConfigError, match="copy_steps must be true or false, got 'yes'"):
        hooks.budget_policy("adaptive", {"copy_steps": "yes"})


# -- the engine ------------------------------------------------------------------------------

@frozen
class NeverDrafts(AdaptivePolicy):
    """Adaptive whose plan turns the draft off on every step, so every step is a copy step or a
    draft-off step."""

    def plan(self, ctx, confidences, caps):
        return StepPlan(draft=False)


class CountingDraft(DraftDouble):
    """The real tiny draft, counting its proposals."""

    def __init__(self, draft) -> None:
        super().__init__(draft)
        self.proposals = 0

    def propose(self, *args, **kwargs):
        self.proposals += 1
        return self.inner.propose(*args, **kwargs)


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=11)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, seed=4)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, MAX_TOKENS)


def run(target, draft, prompts, copy_steps, *, batch=4, overlap=False, graphs=None):
    config = EngineConfig(draft_width=WIDTH, policy="adaptive", request_buckets=tuple(b for b in BUCKETS if b <= batch),
                          max_model_len=160, schedule_overlap=overlap, copy_proposals="on")
    engine = Engine(target, draft, config, graphs=graphs)
    # rows are cheap against a draft-off step: a confident copy pays
    engine.install_table(draft_off_table(WIDTH, engine.geometry.request_buckets, off_seconds=0.02, per_row=0.0005))
    engine.set_policy(NeverDrafts(copy_steps=copy_steps))
    if graphs is not None:
        engine.warmup()
        engine.mark_ready()
    draft.proposals = 0  # warmup runs the proposal keys once; serving is what counts
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    return engine, outputs


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("batch", [1, 4])
def test_copy_steps_are_exact_run_no_draft_and_save_steps(models, prompts, references, batch, overlap, graphs):
    target, inner = models
    draft = CountingDraft(inner)
    backend = StandInCapturedBackend("cpu") if graphs else None
    engine, outputs = run(target, draft, prompts, True, batch=batch, overlap=overlap, graphs=backend)
    assert [list(o.token_ids) for o in outputs] == references
    counters = engine.counters
    assert counters.copy_steps > 0 and counters.draft_off_steps > 0
    assert counters.copy_steps + counters.draft_off_steps == counters.steps
    # every step of every request was one or the other, and most requests had copy steps
    assert all(o.copy_steps + o.draft_off_steps == o.steps for o in outputs)
    assert sum(o.copy_steps > 0 for o in outputs) > len(outputs) // 2
    # the draft never proposed, and copy steps taught the policy nothing about it
    assert draft.proposals == 0 and engine.policy.learning.advantage == {}
    baseline, plain = run(target, CountingDraft(inner), prompts, False, batch=batch, overlap=overlap)
    assert [list(o.token_ids) for o in plain] == references
    assert baseline.counters.copy_steps == 0 and baseline.counters.draft_off_steps == baseline.counters.steps
    # the repeating tiny output is copied: far fewer steps than one token per request each
    assert counters.steps < 0.7 * baseline.counters.steps


def test_a_multi_rank_launch_turns_copy_steps_off_and_refuses_them_by_name():
    from dspark_core.distributed.launch import single_rank_options_off

    with pytest.raises(ConfigError, match="copy_steps=true runs on one rank only"):
        single_rank_options_off("adaptive", {"copy_steps": True, "tier_lag": 0})
    assert single_rank_options_off("adaptive", {"tier_lag": 1}) == {"tier_lag": 1, "copy_steps": False}
    assert single_rank_options_off("fixed", {"k": 3}) == {"k": 3}
