"""The ``timed`` draft-off rule: adaptive judges drafting on measured step times, not on table prices."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.records import StepReport
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.plugins import default_hooks
from dspark_core.policy import TierContext
from engine_support import OracleDraft, draft_off_table, greedy_references, random_prompts, tiny_pair
from dspark_plugins.policies.adaptive import FIRST_REFERENCE_INTERVAL, AdaptivePolicy, DraftLearning

WIDTH = 5
TOKENS = 72


def timed(**options) -> AdaptivePolicy:
    return default_hooks().budget_policy("adaptive", {"draft_off_rule": "timed", **options})


def report(*, drafted: bool, committed: int, seconds: float | None, live: int = 1, bucket: int = 1) -> StepReport:
    rows = bucket * (WIDTH + 1) if drafted else bucket
    accepted = tuple([committed // live - 1] * live)
    return StepReport(live, bucket, rows, accepted, accepted, False, predicted_tokens=float(committed),
                      committed_tokens=committed, draft_off=not drafted, step_seconds=seconds)


# -- the learning --------------------------------------------------------------------------------

def test_a_switch_pairs_the_step_with_the_other_kinds_recent_rate():
    learning = DraftLearning()
    assert learning.record_timed(1, True, 30.0) is None  # nothing to compare with yet
    assert learning.record_timed(1, True, 50.0) is None  # no switch
    drafted_run = 30.0 + 0.3 * (50.0 - 30.0)
    assert learning.record_timed(1, False, 20.0) == pytest.approx(drafted_run / 20.0)  # drafted -> off
    assert learning.record_timed(1, True, 10.0) == pytest.approx(10.0 / 20.0)  # off -> drafted: that run alone
    assert learning.advantage_steps[1] == 2
    assert learning.record_timed(4, False, 20.0) is None  # another bucket breaks the pair ...
    assert learning.record_timed(1, False, 20.0) is None  # ... both ways
    assert learning.record_timed(1, True, 40.0) == pytest.approx(2.0)  # a run of one step, started afresh


def test_steps_are_judged_by_their_measured_seconds_not_the_tables_prices():
    # the table would call this step a win (6 tokens, priced like a draft-off step); measured, it took
    # six times as long as the draft-off step after it, so drafting bought exactly as much
    ctx_costs = dict(tiers=(1, 6), tier_costs=np.array([0.01, 0.01]), draft_off_cost=0.01)
    policy = timed()
    for drafted, committed, seconds in [(True, 6, 0.06), (False, 1, 0.01), (True, 6, 0.06)]:
        policy.observe(StepReport(1, 1, 6 if drafted else 1, (5,) if drafted else (0,), (committed - 1,), False,
                                  predicted_tokens=6.0, committed_tokens=committed, draft_off=not drafted,
                                  step_seconds=seconds, **ctx_costs))
    assert policy.learning.advantage[1] == pytest.approx(1.0)
    untimed = timed()
    untimed.observe(report(drafted=True, committed=6, seconds=None))
    untimed.observe(report(drafted=False, committed=1, seconds=None))
    assert untimed.learning.advantage == {}


def context() -> TierContext:
    return TierContext(1, 1, WIDTH, (1, 2, 3, 4, 5, 6), np.linspace(0.02, 0.025, 6), 0.012)


def test_references_grow_rarer_while_drafting_clearly_pays_and_start_over_near_even():
    policy = timed()
    confidences, caps = np.full((1, WIDTH), 0.9), np.full(1, WIDTH)
    gaps, since = [], 0
    for _ in range(400):
        plan = policy.plan(context(), confidences, caps)
        since += 1
        if not plan.draft:
            assert plan.reference
            gaps.append(since)
            since = 0
        # drafting buys three times the draft-off rate, measured
        policy.observe(report(drafted=plan.draft, committed=6 if plan.draft else 1, seconds=0.02 if plan.draft else 0.01))
    assert gaps[0] == FIRST_REFERENCE_INTERVAL
    assert gaps == sorted(gaps) and gaps[-1] > 4 * FIRST_REFERENCE_INTERVAL
    # a reference then costs (3 - 1) / 3 of a step over the gap: within the probe budget
    assert (2 / 3) / gaps[-1] <= 2 * policy.probe_budget
    # drafting now buys half the draft-off rate: a reference comes after a quarter of the long gap, not
    # all of it, and the draft goes off within a few hundred steps (the mean remembers ~20 measurements of 3x)
    long_gap = policy.learning.reference_interval
    assert long_gap >= 4 * FIRST_REFERENCE_INTERVAL
    drafted = []
    for _ in range(400):
        plan = policy.plan(context(), confidences, caps)
        drafted.append(plan.draft)
        policy.observe(report(drafted=plan.draft, committed=1, seconds=0.02 if plan.draft else 0.01))
    assert not all(drafted[: long_gap // 4 + 1])
    assert sum(drafted[-100:]) <= 25  # probes only


def test_the_other_rules_run_no_references():
    for rule in ("realized", "confidence"):
        policy = default_hooks().budget_policy("adaptive", {"draft_off_rule": rule})
        plans = [policy.plan(context(), np.full((1, WIDTH), 0.9), np.full(1, WIDTH)) for _ in range(50)]
        assert all(p.draft and not p.reference for p in plans)


def test_the_rule_is_validated_by_name():
    assert timed().draft_off_rule == "timed"
    with pytest.raises(ConfigError, match=r"draft_off_rule must be one of \['confidence', 'realized', 'timed'\], got 'clock'"):
        default_hooks().budget_policy("adaptive", {"draft_off_rule": "clock"})


# -- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=5)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(2, seed=3)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, TOKENS)


class SlowOracle(OracleDraft):
    """A good draft whose proposal takes ``delay`` seconds: what a draft too slow for its device looks like.
    The table (20 ms + 1 ms a row drafted, 12 ms draft-off) knows nothing of it."""

    delay = 0.0

    def propose(self, anchors, positions, slots, depth=None):
        time.sleep(self.delay)
        return super().propose(anchors, positions, slots, depth)


def run(models, prompts, references, rule: str, delay: float, overlap: bool):
    target, draft = models
    double = SlowOracle(draft, {tuple(p): r for p, r in zip(prompts, references)}, seed=1, corrupt=0.1)
    double.delay = delay
    engine = Engine(target, double, EngineConfig(draft_width=WIDTH, request_buckets=(1, 2), max_model_len=160,
                                                 schedule_overlap=overlap, policy_options={"draft_off_rule": rule}))
    double.engine = engine
    engine.install_table(draft_off_table(WIDTH, (1, 2)))
    reports: list[StepReport] = []
    engine.add_observer(reports.append)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    engine.close()
    for output, reference in zip(outputs, references):
        assert list(output.token_ids) == reference  # exact, whatever the rule decides
    return reports


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_draft_too_slow_for_the_device_is_turned_off_by_the_timed_rule_only(models, prompts, references, overlap):
    # each proposal sleeps 60 ms while a tiny step takes a few: drafting loses however many tokens it
    # commits, but the table prices it as paying, so only measured times can tell
    slow = run(models, prompts, references, "timed", 0.06, overlap)
    assert all(r.step_seconds is not None and r.step_seconds > 0 for r in slow)
    assert all(r.step_seconds >= 0.06 for r in slow if not r.draft_off)
    assert sum(r.draft_off for r in slow) >= 0.6 * len(slow)
    # the realized rule believes the table: it drafts, but for a few tail steps where one request is left
    # in a bucket of its own with nothing measured yet and caps near zero
    priced = run(models, prompts, references, "realized", 0.06, overlap)
    assert sum(r.draft_off for r in priced) <= 0.25 * len(priced)
    assert all(not r.draft_off for r in priced if r.request_bucket == 2)


def test_a_draft_that_pays_keeps_drafting_under_the_timed_rule(models, prompts, references):
    reports = [r for r in run(models, prompts, references, "timed", 0.0, True) if r.request_bucket == 2]
    # both requests live: the references and nothing more (the tail, one request with caps near zero,
    # goes off as under every rule)
    off = sum(r.draft_off for r in reports)
    assert 1 <= off <= len(reports) // FIRST_REFERENCE_INTERVAL + 1
    assert len(reports) >= 2 * FIRST_REFERENCE_INTERVAL
