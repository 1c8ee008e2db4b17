"""Draft-off steps, learning when drafting pays again, and the real age of the tier's confidences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_core.costs.base import CostSample, draft_off_seconds, pool_samples
from dspark_core.engine.costs import TierCosts
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.records import StepReport
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError, TableError
from dspark_core.geometry import Geometry, legal_tiers
from dspark_core.plugins import default_hooks
from dspark_core.policy import TierContext
from dspark_core.table import default_lookup, loads_table, dumps_table
from engine_support import DraftDouble, draft_off_table, greedy_references, random_prompts, tiny_pair

WIDTH = 5
PHASE = 24  # generated tokens per quality phase of the switching draft


def table_with_draft_off(buckets=(1, 2, 4), *, off_seconds=0.012, model="additive"):
    """Drafting steps cost 20 ms + 1 ms per row, draft-off steps ``off_seconds`` (+ 0.5 ms per request)."""
    return draft_off_table(WIDTH, buckets, off_seconds=off_seconds, model=model)


# -- cost models -------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["additive", "sps"])
def test_cost_models_fit_save_and_load_the_draft_off_cost(model):
    table = table_with_draft_off(model=model)
    fit = table.fits[0]
    for b in (1, 2, 4):
        assert fit.cost.predict_draft_off_seconds(b) == pytest.approx(0.012 + 0.0005 * b)
        # the drafting surface is fitted on drafting samples only
        assert fit.cost.predict_seconds(b, b) == pytest.approx(0.02 + 0.001 * b, rel=0.05)
    assert fit.cost.predict_draft_off_seconds(8) is None
    assert fit.coverage.draft_off_buckets == (1, 2, 4)
    pooled = pool_samples([CostSample(1, 1, 0, 0.4, 4, draft_off=True), CostSample(1, 1, 0, 0.6, 4, draft_off=True),
                           CostSample(1, 1, 0, 0.8, 4)])
    assert [(m.draft_off, m.step_seconds, m.windows) for m in pooled] == [(False, 0.2, 1), (True, 0.125, 2)]
    again = loads_table(dumps_table(table), default_lookup())
    assert again == table and again.fits[0].cost.predict_draft_off_seconds(2) == pytest.approx(0.013)


def test_draft_off_costs_are_pooled_where_noise_makes_them_fall_with_the_bucket():
    # Measured on the development CPU: bucket 1's draft-off windows ran slower than bucket 2's.
    # Left alone, that prices drafting at bucket 1 as nearly free next to its own draft-off step.
    windows = {1: (0.0561, 0.0561), 2: (0.0486, 0.0486), 4: (0.0506, 0.0506), 8: (0.0599,), 16: (0.0899,)}
    samples = [CostSample(b, b, 0, 8 * seconds, 8, draft_off=True) for b, ws in windows.items() for seconds in ws]
    off = draft_off_seconds(samples)
    assert list(off) == [1, 2, 4, 8, 16]
    assert list(off.values()) == sorted(off.values())
    # 1, 2 and 4 pool into one window-weighted mean; 8 and 16 were in order and keep their own
    assert off[1] == off[2] == off[4] == pytest.approx((0.0561 + 0.0486 + 0.0506) / 3)
    assert (off[8], off[16]) == (pytest.approx(0.0599), pytest.approx(0.0899))
    # in order already: each bucket keeps its pooled mean, weighted by steps
    ordered = [CostSample(1, 1, 0, 0.4, 8, draft_off=True), CostSample(1, 1, 0, 0.4, 4, draft_off=True),
               CostSample(2, 2, 0, 0.9, 12, draft_off=True), CostSample(2, 2, 0, 0.1, 4)]
    assert draft_off_seconds(ordered) == {1: pytest.approx(0.8 / 12), 2: pytest.approx(0.075)}
    assert draft_off_seconds([CostSample(1, 1, 0, 0.1, 4)]) == {}


def test_a_table_without_draft_off_cost_stays_valid_and_never_turns_the_draft_off():
    params = {"bias_seconds": 0.02, "request_buckets": [1], "alpha_seconds": [0.0], "target_rows": [1, 6],
              "theta_seconds": [0.0, 0.005]}
    table = loads_table('{"model": "additive", "draft_width": 5, "params": %s}' % str(params).replace("'", '"'),
                        default_lookup())
    assert table.fits[0].cost.predict_draft_off_seconds(1) is None
    policy = default_hooks().budget_policy("adaptive", {})
    ctx = TierContext(1, 1, WIDTH, tuple(legal_tiers(1, WIDTH)), np.full(6, 0.02), None)
    assert all(policy.plan(ctx, np.zeros((1, WIDTH)), np.array([WIDTH])).draft for _ in range(50))


def test_draft_off_samples_must_run_one_row_per_request():
    with pytest.raises(ConfigError, match="draft-off sample runs one row per request: bucket 2 needs target_rows 2"):
        CostSample(2, 4, 0, 1.0, 4, draft_off=True)
    with pytest.raises(TableError, match="draft_off_seconds must be > 0"):
        loads_table('{"model": "additive", "draft_width": 5, "params": {"bias_seconds": 0.02, '
                    '"request_buckets": [1], "alpha_seconds": [0.0], "target_rows": [1, 6], "theta_seconds": [0, 0.1],'
                    '"draft_off_buckets": [1], "draft_off_seconds": [-1.0]}}', default_lookup())


# -- the plan --------------------------------------------------------------------------------

def context(off_cost=0.012, scale=1.0):
    tiers = tuple(legal_tiers(1, WIDTH))
    return TierContext(1, 1, WIDTH, tiers, np.array([0.02 + 0.001 * g for g in tiers]), off_cost, scale)


def test_plan_turns_the_draft_off_only_when_one_token_at_the_draft_off_cost_beats_every_tier():
    policy = default_hooks().budget_policy("adaptive", {})
    caps = np.array([WIDTH])
    assert policy.plan(context(), np.full((1, WIDTH), 0.9), caps).draft  # drafting pays
    assert not policy.plan(context(), np.full((1, WIDTH), 0.05), caps).draft  # it does not
    # the same weak draft with a draft-off step that saves nothing: keep drafting
    assert policy.plan(context(off_cost=0.021), np.full((1, WIDTH), 0.05), caps).draft
    # other engines' rule keeps drafting whatever it costs
    assert default_hooks().budget_policy("min-gain", {}).plan(context(), np.full((1, WIDTH), 0.05), caps).draft


def test_no_drafted_tier_is_priced_below_the_draft_off_step():
    """A fit whose drafted curve starts below the draft-off price would make a proposal look free:
    adaptive would draft on every step of a weak draft and verify nothing drafted."""
    table = table_with_draft_off(off_seconds=0.030)  # drafting fitted at 21-44 ms, draft-off at 30.5-32 ms
    geometry = Geometry.all_tiers(WIDTH, (1, 2, 4))
    costs = TierCosts(geometry)
    costs.install(table)
    for bucket in (1, 2, 4):
        off, fitted = costs.draft_off_for_step(bucket, 100), table.fits[0].cost
        tiers = costs.for_step(bucket, 100)
        assert tiers[0] == pytest.approx(off)  # the zero-drafted-row tier costs what draft-off costs
        raw = np.array([fitted.predict_seconds(bucket, g) for g in geometry.rows_for(bucket)])
        np.testing.assert_allclose(np.diff(tiers), np.diff(raw))  # each extra row as fitted
    weak, caps = np.full((1, WIDTH), 0.01), np.array([WIDTH])
    ctx = TierContext(1, 1, WIDTH, geometry.rows_for(1), costs.for_step(1, 100), costs.draft_off_for_step(1, 100))
    assert not default_hooks().budget_policy("adaptive", {}).plan(ctx, weak, caps).draft
    # a draft-off step priced above every drafted tier leaves the curve alone
    cheap_off = TierCosts(geometry)
    cheap_off.install(table_with_draft_off(off_seconds=0.012))
    np.testing.assert_allclose(cheap_off.for_step(2, 100), [table.fits[0].cost.predict_seconds(2, g)
                                                            for g in geometry.rows_for(2)])


def test_probing_backs_off_while_drafting_does_not_pay_and_resets_when_it_does():
    policy = default_hooks().budget_policy("adaptive", {"max_probe_interval": 16})
    weak, strong, caps = np.full((1, WIDTH), 0.05), np.full((1, WIDTH), 0.9), np.array([WIDTH])
    plans = [policy.plan(context(), weak, caps) for _ in range(60)]
    probes = [i for i, p in enumerate(plans) if p.draft]
    assert all(plans[i].probe and plans[i].forecast_scale == 1.0 for i in probes)
    assert np.diff(probes).tolist() == [9, 17, 17]  # gaps of 4, 8, 16 (capped) off-steps between probes
    assert policy.plan(context(), strong, caps).draft  # a good proposal turns drafting back on ...
    plans = [policy.plan(context(), weak, caps) for _ in range(6)]
    assert [p.draft for p in plans] == [False] * 4 + [True, False]  # ... and the backoff starts over


def drafted(committed: int, rows: int = 6, bucket: int = 1) -> StepReport:
    """A processed drafting step of ``context()``'s costs: ``rows`` target rows, ``committed`` tokens."""
    tiers = tuple(legal_tiers(1, WIDTH))
    return StepReport(1, bucket, rows, (rows - 1,), (committed - 1,), False, predicted_tokens=2.0,
                      committed_tokens=committed, tiers=tiers, tier_costs=np.array([0.02 + 0.001 * g for g in tiers]),
                      draft_off_cost=0.012)


def test_realized_rule_drafts_on_what_drafting_bought_not_on_one_weak_block():
    policy = default_hooks().budget_policy("adaptive", {})
    weak, strong, caps = np.full((1, WIDTH), 0.05), np.full((1, WIDTH), 0.9), np.array([WIDTH])
    for _ in range(3):
        policy.observe(drafted(3))  # 3 tokens in a 26 ms step against 1 token in a 12 ms draft-off step
    assert policy.learning.advantage == {1: pytest.approx((3 / 0.026) / (1 / 0.012))}
    policy.observe(StepReport(1, 1, 1, (0,), (0,), False, predicted_tokens=1.0, committed_tokens=1, draft_off=True,
                              draft_off_cost=0.012))
    assert policy.learning.advantage[1] == pytest.approx(1.3846, abs=1e-3)  # draft-off steps teach nothing
    # one weak block does not turn off a draft that has been paying; the confidence rule would
    assert policy.plan(context(), weak, caps).draft
    confidence = default_hooks().budget_policy("adaptive", {"draft_off_rule": "confidence"})
    confidence.observe(drafted(3))
    assert not confidence.plan(context(), weak, caps).draft
    for _ in range(60):
        policy.observe(drafted(1))  # drafting stops paying: one token per 26 ms step, steadily
    assert policy.learning.advantage[1] < 1.0
    assert not policy.plan(context(), strong, caps).draft  # however confident the block looks
    policy.observe(drafted(3, bucket=4))
    assert policy.learning.advantage[4] > 1.0 > policy.learning.advantage[1]  # each bucket learns its own


@pytest.mark.parametrize("committed,gaps", [((1, 3), [5, 5, 5, 5]), ((1, 1), [9, 17, 17])],
                         ids=["noisy-near-even", "steadily-below"])
def test_probes_stay_frequent_while_drafting_measured_near_even(committed, gaps):
    # margin 0: the draft goes off as soon as the mean is below 1 (the default margin would keep
    # drafting through the noisy case, see the next test), so the probe gaps can be watched
    policy = default_hooks().budget_policy("adaptive", {"max_probe_interval": 16, "draft_off_margin": 0.0,
                                                        "realized_decay": 0.8})
    for i in range(20):  # ratios 0.46 and 1.38 alternating: mean 0.9, within a standard error of 1
        policy.observe(drafted(committed[i % 2]))
    assert policy.learning.advantage[1] < 1.0
    plans = [policy.plan(context(), np.full((1, WIDTH), 0.05), np.array([WIDTH])) for _ in range(60)]
    probes = [i for i, p in enumerate(plans) if p.draft]
    assert np.diff(probes).tolist()[: len(gaps)] == gaps


@pytest.mark.parametrize("margin,noisy_drafts,steady_drafts", [(0.0, False, False), (1.0, True, False)])
def test_draft_off_margin_needs_the_loss_to_stand_out_from_the_noise(margin, noisy_drafts, steady_drafts):
    # One request on a CPU: a step's ratio is 0.46 (no draft token accepted) or 1.38 (two), so a
    # mean of 0.9 over a few steps is well within the noise of a draft that pays on average.
    # a short memory (0.8 per drafted step), where one standard error is wide
    noisy = default_hooks().budget_policy("adaptive", {"draft_off_margin": margin, "realized_decay": 0.8})
    for i in range(20):
        noisy.observe(drafted((1, 3)[i % 2]))
    assert noisy.learning.advantage[1] + noisy.learning.advantage_error(1) > 1.0 > noisy.learning.advantage[1]
    weak, caps = np.full((1, WIDTH), 0.05), np.array([WIDTH])
    assert noisy.plan(context(), weak, caps).draft is noisy_drafts
    # a draft that steadily buys one token per drafted step is switched off under any margin
    steady = default_hooks().budget_policy("adaptive", {"draft_off_margin": margin, "realized_decay": 0.8})
    for _ in range(20):
        steady.observe(drafted(1))
    assert steady.plan(context(), weak, caps).draft is steady_drafts


def test_a_few_identical_steps_do_not_turn_a_draft_off():
    # Two drafted steps that each bought one token at 0.9x the draft-off rate measure no spread at
    # all; read literally, their standard error is 0 and the first unlucky steps of a run would turn
    # the draft off (seen on the CPU: off on 80 of a request's 88 steps while drafting paid 1.2x).
    tiers = tuple(legal_tiers(1, WIDTH))

    def near_even() -> StepReport:
        return StepReport(1, 1, 6, (5,), (0,), False, predicted_tokens=2.0, committed_tokens=1, tiers=tiers,
                          tier_costs=np.full(len(tiers), 0.012 / 0.9), draft_off_cost=0.012)

    weak, caps = np.full((1, WIDTH), 0.05), np.array([WIDTH])
    policy = default_hooks().budget_policy("adaptive", {})
    assert policy.learning.advantage_error(1) == float("inf")  # nothing measured yet
    for _ in range(2):
        policy.observe(near_even())
    assert policy.learning.advantage[1] == pytest.approx(0.9)
    assert policy.learning.advantage_error(1) > 0.3  # the prior spread, over two steps
    assert policy.plan(context(), weak, caps).draft
    literal = default_hooks().budget_policy("adaptive", {"realized_prior_steps": 0})
    for _ in range(2):
        literal.observe(near_even())
    assert literal.learning.advantage_error(1) == 0.0 and not literal.plan(context(), weak, caps).draft
    # the same steps, steadily: the evidence piles up and the draft goes off within a dozen or so
    for n in range(3, 60):
        policy.observe(near_even())
        if not policy.plan(context(), weak, caps).draft:
            break
    assert 8 <= n <= 20
    # a step of 16 requests averages 16 ratios: its prior spread is a quarter as wide
    wide = default_hooks().budget_policy("adaptive", {})
    wide.learning.record_advantage(16, 0.9)
    policy_one = default_hooks().budget_policy("adaptive", {})
    policy_one.learning.record_advantage(1, 0.9)
    assert wide.learning.advantage_error(16) == pytest.approx(policy_one.learning.advantage_error(1) / 4)


def test_realized_decay_sets_how_long_the_rule_remembers():
    # three paying steps, then steady one-token steps: a short memory turns the draft off sooner
    def steps_until_off(decay: float) -> int:
        policy = default_hooks().budget_policy("adaptive", {"realized_decay": decay})
        for _ in range(3):
            policy.observe(drafted(3))
        for n in range(1, 100):
            policy.observe(drafted(1))
            if not policy.plan(context(), np.full((1, WIDTH), 0.05), np.array([WIDTH])).draft:
                return n
        return 100

    assert default_hooks().budget_policy("adaptive", {}).learning.advantage_decay == 0.95
    assert steps_until_off(0.5) < steps_until_off(0.8) < steps_until_off(0.95) < 100


def test_observed_acceptance_scales_the_forecast():
    policy = default_hooks().budget_policy("adaptive", {})
    report = StepReport(1, 1, 6, (5,), (0,), False, predicted_tokens=1 + 4.0, committed_tokens=1)
    for _ in range(10):
        policy.observe(report)  # expected 4 drafted tokens, none accepted
    assert policy.learning.scale < 0.15
    # now the forecast of a 0.9-confidence block is far below one extra token: not worth drafting
    plan = policy.plan(context(), np.full((1, WIDTH), 0.9), np.array([WIDTH]))
    assert not plan.draft
    # with the correction off the same policy trusts the confidences
    trusting = default_hooks().budget_policy("adaptive", {"forecast_correction": False})
    for _ in range(10):
        trusting.observe(report)
    assert trusting.plan(context(), np.full((1, WIDTH), 0.9), np.array([WIDTH])).draft
    # drafted steps that verify nothing teach nothing: the scale relaxes back towards 1
    idle = StepReport(1, 1, 1, (0,), (0,), False, predicted_tokens=1.0, committed_tokens=1, forecast_scale=0.1)
    for _ in range(15):
        policy.observe(idle)
    assert policy.learning.scale > 0.95


@pytest.mark.parametrize("options,match", [
    ({"draft_off": "yes"}, "draft_off must be true or false"),
    ({"max_probe_interval": 0}, "max_probe_interval must be an integer >= 1"),
    ({"tier_lag": True}, "tier_lag must be 0, 1 or 2"),
    ({"draft_off_rule": "always"}, "draft_off_rule must be"),
    ({"draft_off_margin": -1}, r"draft_off_margin must be a number in \[0, 10\], got -1"),
    ({"draft_off_margin": "wide"}, "draft_off_margin must be a number"),
    ({"realized_decay": 1}, r"realized_decay must be a number in \(0, 1\), got 1"),
    ({"realized_decay": 0}, r"realized_decay must be a number in \(0, 1\), got 0"),
    ({"realized_decay": True}, "realized_decay must be a number"),
    ({"realized_prior_steps": -1}, r"realized_prior_steps must be a number in \[0, 1000\], got -1"),
    ({"realized_prior_steps": "2"}, "realized_prior_steps must be a number"),
])
def test_new_options_are_validated(options, match):
    with pytest.raises(ConfigError, match=match):
        default_hooks().budget_policy("adaptive", options)


# -- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=11)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=7)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, 4 * PHASE)


class SwitchingDraft(DraftDouble):
    """Test double: drafts the target's true continuation in good phases and wrong tokens in
    useless ones, always claiming confidence 0.9, so only realized acceptance tells them apart.
    The phase follows the generated-token index of the anchor: good, useless, good, useless."""

    def __init__(self, draft, prompts, references) -> None:
        super().__init__(draft)
        self.truth = {tuple(p): list(p) + r for p, r in zip(prompts, references)}
        self.engine = None

    def propose(self, anchors, positions, slots):
        tokens, confidences = self.inner.propose(anchors, positions, slots)
        confidences.fill_(0.9)
        for r in range(tokens.shape[0]):
            request = next((q for q in list(self.engine.scheduler.running) if q.slot == int(slots[r])), None)
            if request is None:
                continue
            pos, seq = int(positions[r]), self.truth[tuple(request.prompt)]
            good = ((pos - len(request.prompt) + 1) // PHASE) % 2 == 0
            for j, tok in enumerate(seq[pos + 1 : pos + 1 + tokens.shape[1]]):
                tokens[r, j] = tok if good else (tok + 1) % self.config.target_vocab_size
        return tokens, confidences


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("batch", [1, 3])
def test_switching_draft_exact_and_drafting_follows_quality(models, prompts, references, overlap, batch):
    target, draft = models
    double = SwitchingDraft(draft, prompts, references)
    # a short realized memory and no margin, so 24-token phases are long enough to react in; the
    # defaults remember ~20 drafted steps and wait for a clear loss (benchmarks/results/policy-replay)
    engine = Engine(target, double, EngineConfig(draft_width=WIDTH, request_buckets=(1, 2, 4), max_model_len=160,
                                                 schedule_overlap=overlap,
                                                 policy_options={"realized_decay": 0.8, "draft_off_margin": 0.0}))
    double.engine = engine
    engine.install_table(table_with_draft_off())
    phases: list[tuple[bool, bool, int]] = []  # (good phase, drafted, committed) per step, one request tracked
    tracked = engine.add_request(prompts[0], SamplingParams(max_tokens=4 * PHASE, ignore_eos=True))
    others = [engine.add_request(p, SamplingParams(max_tokens=4 * PHASE, ignore_eos=True)) for p in prompts[1:batch]]

    def observe(report: StepReport) -> None:
        produced = len(tracked.output)
        if tracked.finish_reason is None and produced < 4 * PHASE:
            phases.append(((produced // PHASE) % 2 == 0, not report.draft_off, report.accepted[0] + 1))

    engine.add_observer(observe)
    done = {}
    while len(done) < batch:
        done.update({o.request_id: o for o in engine.step()})
    engine.close()
    for request, reference in zip([tracked, *others], references):
        assert list(done[request.request_id].token_ids) == reference
    good = [s for s in phases if s[0]]
    useless = [s for s in phases if not s[0]]
    # useless phases: at least half draft-off steps. The realized rule averages about nine drafted
    # steps (one real step's worth is noisy), so it takes ~7 of the 24 useless steps to turn the draft
    # off, and probes every few steps while drafting measured near even; a policy that never turns
    # the draft off scores 0 here
    assert sum(not drafted for _, drafted, _ in useless) >= 0.5 * len(useless)
    # good phases: drafting resumes and pays (several tokens per step on average)
    assert sum(committed for *_, committed in good) / len(good) > 2.0
    assert engine.counters.draft_off_steps > 0


def test_draft_off_steps_extend_the_draft_context(models, prompts):
    """After draft-off steps the draft proposes exactly what it would have without them."""
    target, draft = models
    prompt = prompts[0]

    def first_proposal_after(steps_off: int, policy: str):
        engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, request_buckets=(1,), max_model_len=160,
                                                    policy=policy))
        if policy == "adaptive":
            engine.install_table(table_with_draft_off((1,), off_seconds=0.0001))  # off whenever it may
        request = engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        while len(request.output) < steps_off + 1:
            engine.step()
        anchors, positions = engine.storage.anchors(torch.tensor([request.slot]))
        proposal = engine.runner.propose(anchors, positions, torch.tensor([request.slot]))
        engine.close()
        return len(request.output), proposal, engine.counters

    # target-only steps through the draft-off path vs the same tokens committed by fixed k=0 steps
    produced_off, (tokens_off, conf_off), counters = first_proposal_after(3, "adaptive")
    assert counters.draft_off_steps >= 1
    fixed = Engine(target, draft, EngineConfig(draft_width=WIDTH, request_buckets=(1,), max_model_len=160,
                                               policy="fixed", policy_options={"k": 0}))
    request = fixed.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while len(request.output) < produced_off:
        fixed.step()
    anchors, positions = fixed.storage.anchors(torch.tensor([request.slot]))
    tokens_k0, conf_k0 = fixed.runner.propose(anchors, positions, torch.tensor([request.slot]))
    fixed.close()
    assert torch.equal(tokens_off, tokens_k0)
    assert torch.allclose(conf_off, conf_k0)


def test_queued_draft_context_rows_are_written_newest_last_per_slot_and_position():
    """Queued rows (draft-off steps, rewritten rejected rows, a reused slot) flush in one write
    with the same cache as writing each step's rows in order; nothing is written before a flush."""
    import copy

    from dspark_core.engine.runner import ModelRunner

    target, draft = tiny_pair(seed=3)
    runner = ModelRunner(target, copy.deepcopy(draft), draft_width=WIDTH, num_slots=2, max_len=32)
    reference = copy.deepcopy(draft).bind_target(target)
    reference.allocate_context(3, 32)
    g = torch.Generator().manual_seed(0)
    width = len(draft.config.aux_layer_ids) * draft.config.target_hidden_size
    steps = [(0, range(0, 10)), (1, range(0, 6)), (0, range(6, 9)),  # slot 0 rows 6..8 rewritten
             (0, range(0, 4)), (2, [0, 0, 0])]  # slot 0 reused by a shorter prompt; scratch padding
    empty = runner.draft.context.keys.clone()
    for slot, positions in steps:
        positions = torch.tensor(list(positions))
        hidden = torch.randn(len(positions), width, generator=g, dtype=torch.float64)
        slots = torch.full_like(positions, slot)
        runner.extend_draft_context(hidden, positions, slots)
        reference.extend_context(hidden, positions, slots)
    assert torch.equal(runner.draft.context.keys, empty)  # queued, not written
    runner.flush_draft_context()
    for cache in ("keys", "values"):  # slots 0 and 1 (the scratch slot's content is never read), up to
        # the rounding of one batched projection against one per step
        written, expected = getattr(runner.draft.context, cache)[:, :2], getattr(reference.context, cache)[:, :2]
        assert torch.allclose(written, expected, rtol=1e-12, atol=1e-12)
    before = runner.draft.context.keys.clone()
    runner.flush_draft_context()  # nothing queued: a no-op
    assert torch.equal(runner.draft.context.keys, before)


def _queue_and_reference(seed: int, max_rows: int = 4096):
    """A draft-context queue over a copy of a tiny draft, and a second copy written directly."""
    import copy

    from dspark_core.engine.draft_context import DraftContextQueue

    target, draft = tiny_pair(seed=seed)
    queued, direct = (copy.deepcopy(draft).bind_target(target) for _ in range(2))
    for d in (queued, direct):
        d.allocate_context(3, 32)
    queue = DraftContextQueue(queued, num_slots=2, max_len=32, scratch_slot=2, max_rows=max_rows)
    width = len(draft.config.aux_layer_ids) * draft.config.target_hidden_size
    g = torch.Generator().manual_seed(seed)

    def rows(slot, positions):
        positions = torch.tensor(list(positions))
        return torch.randn(len(positions), width, generator=g, dtype=torch.float64), positions, torch.full_like(positions, slot)

    return queue, queued, direct, rows


def test_rows_of_ended_requests_are_dropped_not_written():
    queue, queued, direct, rows = _queue_and_reference(seed=4)
    old = rows(0, range(0, 10))
    queue.put(*old)
    queue.release(0)  # the request in slot 0 ended; a new one reuses the slot with a shorter prompt
    new, other = rows(0, range(0, 4)), rows(1, range(0, 6))
    for part in (new, other):
        queue.put(*part)
        direct.extend_context(*part)
    queue.flush()
    keys = queued.context.keys
    assert torch.allclose(keys[:, :2], direct.context.keys[:, :2], rtol=1e-12, atol=1e-12)
    assert not keys[:, 0, :, 4:10].any()  # the ended request's rows past the new prompt: never written


def test_a_full_queue_drops_ended_rows_first_and_writes_only_when_still_full():
    queue, queued, direct, rows = _queue_and_reference(seed=5, max_rows=12)
    queue.put(*rows(0, range(0, 8)))
    queue.release(0)
    queue.put(*rows(1, range(0, 5)))  # 13 rows: the 8 dead ones go, nothing is written yet
    assert queue.rows == 5 and not queued.context.keys.any()
    queue.put(*rows(1, range(5, 12)))  # 12 live rows: written
    assert queue.rows == 0 and queued.context.keys[:, 1, :, :12].abs().sum(dim=-1).all()
    assert not queued.context.keys[:, 0].any()


# -- the age of the tier's confidences ---------------------------------------------------------

class StampingDraft(DraftDouble):
    """Test double: every proposal's confidences encode the number of the step that made it."""

    def __init__(self, draft) -> None:
        super().__init__(draft)
        self.calls = 0

    def propose(self, anchors, positions, slots):
        tokens, confidences = self.inner.propose(anchors, positions, slots)
        self.calls += 1
        return tokens, torch.full_like(confidences, 0.5 + self.calls / 10000)


class AgeRecorder:
    """Wraps a policy; on every tier decision records how many steps old its confidences are."""

    def __init__(self, inner, draft: StampingDraft) -> None:
        self.inner, self.draft = inner, draft
        self.name, self.uses_draft, self.tier_lag = inner.name, True, inner.tier_lag
        self.ages: list[int] = []

    def choose_tier(self, ctx, confidences, caps):
        value = float(confidences[0, 0])
        if value != 1.0:  # 1.0: nothing drafted that long ago yet
            self.ages.append(self.draft.calls - round((value - 0.5) * 10000))
        return self.inner.choose_tier(ctx, confidences, caps)

    def split(self, *args):
        return self.inner.split(*args)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy,options,lag", [("adaptive", {"tier_lag": 0}, 0), ("adaptive", {"tier_lag": 1}, 1),
                                                ("adaptive", {"tier_lag": 2}, 2), ("stale-argmax", {}, 1),
                                                ("argmax-notier", {}, 2)])
def test_tier_confidences_are_exactly_tier_lag_steps_old(models, prompts, references, policy, options, lag, overlap):
    target, draft = models
    stamping = StampingDraft(draft)
    engine = Engine(target, stamping, EngineConfig(draft_width=WIDTH, request_buckets=(1,), max_model_len=160,
                                                   schedule_overlap=overlap))
    engine.install_table(table_with_draft_off((1,), off_seconds=1.0))  # draft-off never pays here
    recorder = AgeRecorder(default_hooks().budget_policy(policy, options), stamping)
    engine.set_policy(recorder)
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.close()
    assert list(out[0].token_ids) == references[0][:30]
    assert len(recorder.ages) >= out[0].steps - lag - 1
    assert set(recorder.ages) == {lag}



def test_a_request_without_a_drafted_block_assumes_the_batch_mean_not_full_survival(models, prompts):
    target, draft = models
    stamping = StampingDraft(draft)
    engine = Engine(target, stamping, EngineConfig(draft_width=WIDTH, request_buckets=(1, 2), max_model_len=160))
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=30, ignore_eos=True))
    assert np.array_equal(engine.planner.confidences_up_to(first, 0), np.ones(WIDTH))  # nothing drafted yet
    for _ in range(4):
        engine.step()
    newcomer = engine.add_request(prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
    newest = first.confidence_history[-1]
    assert not newcomer.confidence_history
    assert np.allclose(engine.planner.confidences_up_to(newcomer, newest[0]), newest[1])
    # never fresher than asked for: the lag still bounds the age
    older = first.confidence_history[-2]
    assert np.allclose(engine.planner.confidences_up_to(newcomer, older[0]), older[1])
    engine.close()


def test_probes_stop_backing_off_once_their_cost_fits_the_probe_budget():
    # context(): draft-off 12 ms; raw 0.05-confidences pick the widest tier (26 ms), so a probe adds
    # 14 ms, 1.17 draft-off steps; a gap of g off-steps between probes adds 1.17 / g of decoding time
    weak, caps = np.full((1, WIDTH), 0.05), np.array([WIDTH])

    def gaps(options: dict) -> list[int]:
        policy = default_hooks().budget_policy("adaptive", options)
        plans = [policy.plan(context(), weak, caps) for _ in range(400)]
        return np.diff([i for i, p in enumerate(plans) if p.draft]).tolist()

    # budget 10%: the gap doubles 4 -> 8 -> 16 (1.17 / 16 = 7% fits) and stays there
    assert gaps({"probe_budget": 0.1})[:5] == [9, 17, 17, 17, 17]
    # budget 1% (the default): it needs g >= 117, so the gap doubles on to 128
    assert gaps({}) == [9, 17, 33, 65, 129, 129]
    # a cheap probe stops sooner: near-zero confidences pick the 1-row tier (21 ms) over a 20 ms
    # draft-off step, 5% of a step per probe, so 4 -> 8 is enough
    cheap = default_hooks().budget_policy("adaptive", {})
    plans = [cheap.plan(context(off_cost=0.02), np.full((1, WIDTH), 0.001), caps) for _ in range(60)]
    assert np.diff([i for i, p in enumerate(plans) if p.draft]).tolist()[:3] == [9, 9, 9]
    # the hard cap still wins
    assert set(gaps({"probe_budget": 0.0, "max_probe_interval": 16})[2:]) == {17}
    with pytest.raises(ConfigError, match="probe_budget must be a number in"):
        default_hooks().budget_policy("adaptive", {"probe_budget": 2})


def test_sparse_drafting_learns_the_realized_ratio_not_a_prior_blend():
    # one drafted token expected per step, accepted on every other step: the scale must settle
    # around 0.5, not be pulled towards 1 by the prior on every informative step (that gave ~0.69)
    policy = default_hooks().budget_policy("adaptive", {})
    miss = StepReport(1, 1, 2, (1,), (0,), False, predicted_tokens=2.0, committed_tokens=1)
    hit = StepReport(1, 1, 2, (1,), (1,), False, predicted_tokens=2.0, committed_tokens=2)
    scales = []
    for _ in range(20):
        for report in (miss, hit):
            policy.observe(report)
            scales.append(policy.learning.scale)
    assert abs(float(np.mean(scales[-10:])) - 0.5) < 0.06


def test_a_policy_that_never_drafts_queues_nothing_for_the_draft_context():
    """An engine built with a draft that serves `none` (the bench swaps policies on one engine) keeps no
    decode rows for the draft's context; only the prefill's rows wait there (drafting may start later)."""
    target, draft = tiny_pair(seed=4, block_size=WIDTH)
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy="adaptive", request_buckets=(1, 2),
                                                max_model_len=96, schedule_overlap=False))
    with engine.use_policy(default_hooks().budget_policy("none", {})):
        engine.add_request(random_prompts(1, seed=5)[0], SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()  # the prefill and the first decode step
        queued = engine.runner.draft_context.rows
        for _ in range(4):
            engine.step()
        assert queued > 0 and engine.runner.draft_context.rows == queued
    engine.close()
