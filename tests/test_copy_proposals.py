"""Copy proposals (prompt lookup in front of the draft's block): the lookup kernel against a loop
reference, the token history it reads, exactness for every policy, captured equal to eager, and
the settings (draft config, flags, the runtime switch), and copy steps (a draft-off step that still
verifies the copies the request's own text offers).

The tiny random target's greedy output soon repeats itself, so copies are found and accepted
here while the random draft's own tokens almost never are: the steps a run saves show that
copies ran."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_support import StandInCapturedBackend, host_reads
from dspark_core.engine.copies import DEFAULT_COPY_CONFIDENCE, DEFAULT_COPY_ORDERS, copy_settings
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError, ModelError
from dspark_core.graphs import static_shapes
from dspark_core.models.draft_config import DraftConfig
from dspark_core.models.speculators_io import config_from_speculators, config_to_speculators
from dspark_core.plugins import default_hooks
from dspark_core.policy import TierContext, copy_step_choice, verifies_past_depth
from dspark_kernels.copy_lookup import copy_lookup, copy_lookup_reference
from engine_support import (DraftDouble, NeverDrafts, draft_off_table, greedy_references, random_prompts, synthetic_table,
                            tiny_pair)

MAX_TOKENS = 40
BUCKETS = (1, 2, 4, 8, 16)


# -- the kernel ------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=5),
       st.sampled_from([(1,), (2,), (3,), (3, 2), (4, 3, 2, 1), (6, 5, 4, 3, 2)]), st.sampled_from([5, 7]))
def test_lookup_kernel_equals_the_loop_reference(sequences, orders, width):
    """A small vocabulary makes repeats (and several earlier occurrences) common."""
    columns = 34
    history = torch.full((len(sequences) + 1, columns), 9, dtype=torch.int64)  # 9: never a written token
    for slot, tokens in enumerate(sequences):
        history[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    seq_len = torch.tensor([len(t) for t in sequences] + [0])
    slots = torch.arange(len(sequences)).flip(0)  # any order of slots
    tokens, counts, chosen = copy_lookup(history, slots, seq_len, orders, width)
    for row, slot in enumerate(slots.tolist()):
        want, order = copy_lookup_reference(sequences[slot], orders, width)
        assert counts[row].item() == len(want)
        assert tokens[row].tolist() == (want or [0] * width)
        assert chosen[row].item() == (len(orders) if order is None else orders.index(order))


def test_lookup_prefers_long_keys_takes_the_latest_occurrence_and_repeats_before_the_anchor():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 7, 1, 2, 8, 9, 4, 1, 2]  # key (1, 2) ends at 1 and 4 (and at 9, the anchor)
    history = torch.tensor([tokens + [5] * 6])
    copied, count, chosen = copy_lookup(history, torch.tensor([0]), torch.tensor([10]), (2,), 7)
    # from 4 on: 8 9 4 1 2, then again from 8 (period 5), never past the anchor
    assert count.tolist() == [7] and copied[0].tolist() == [8, 9, 4, 1, 2, 8, 9] and chosen.tolist() == [0]
    assert copy_lookup_reference(tokens, (2,), 7) == ([8, 9, 4, 1, 2, 8, 9], 2)
    # (4, 1, 2) occurs only as the key itself, so the 2-token key decides
    assert copy_lookup_reference(tokens, (3, 2), 7) == ([8, 9, 4, 1, 2, 8, 9], 2)
    # here the 3-token key (4, 1, 2) occurred, earlier than the latest (1, 2): the longer key wins
    longer = [4, 1, 2, 3, 7, 1, 2, 6, 4, 1, 2]  # (4, 1, 2) at 0..2, (1, 2) latest at 5..6
    assert copy_lookup_reference(longer, (3, 2), 3) == ([3, 7, 1], 3)
    assert copy_lookup_reference(longer, (2,), 3) == ([6, 4, 1], 2)
    copied, _, chosen = copy_lookup(torch.tensor([longer]), torch.tensor([0]), torch.tensor([11]), (3, 2), 3)
    assert copied[0].tolist() == [3, 7, 1] and chosen.tolist() == [0]
    _, none, chosen = copy_lookup(history, torch.tensor([0]), torch.tensor([3]), (2,), 7)  # [1, 2, 7]: no earlier (2, 7)
    assert none.tolist() == [0] and chosen.tolist() == [1]


# -- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=11)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, seed=4)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, MAX_TOKENS)


def run(target, draft, prompts, policy, options=None, *, copies="on", batch=16, overlap=False, graphs=None,
        width=7, table=None, on_ready=None, depths=()):
    """Generate ``prompts`` greedily; ``policy`` is a name, or a policy object an adaptive engine serves
    with. ``table`` replaces the synthetic cost table; ``on_ready(engine)`` runs once warmup is done."""
    name = policy if isinstance(policy, str) else "adaptive"
    config = EngineConfig(draft_width=width, policy=name, policy_options=options or {},
                          request_buckets=tuple(b for b in BUCKETS if b <= batch), max_model_len=160,
                          schedule_overlap=overlap, copy_proposals=copies, draft_depths=depths)
    engine = Engine(target, draft, config, graphs=graphs)
    engine.install_table(table or synthetic_table(width, engine.geometry.request_buckets))
    if not isinstance(policy, str):
        engine.set_policy(policy)
    if graphs is not None:
        engine.warmup()
        engine.mark_ready()
    if on_ready is not None:
        on_ready(engine)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    return engine, outputs


POLICIES = [("none", {}), ("adaptive", {})] + [("fixed", {"k": k}) for k in (0, 1, 3, 7)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("policy,options", POLICIES, ids=str)
def test_every_policy_is_exact_with_copies(models, prompts, references, policy, options, batch, overlap):
    target, draft = models
    engine, outputs = run(target, draft, prompts, policy, options, batch=batch, overlap=overlap)
    assert [list(o.token_ids) for o in outputs] == references
    if policy != "none" and options.get("k", 1) > 0:
        # the random draft alone is almost never accepted; copies of the repeating output are
        assert sum(o.accepted_length for o in outputs) / len(outputs) > 1.3


def test_copies_save_steps_and_off_means_the_draft_alone(models, prompts, references):
    target, draft = models
    with_copies, out_on = run(target, draft, prompts, "fixed", {"k": 7}, copies="on")
    without, out_off = run(target, draft, prompts, "fixed", {"k": 7}, copies="off")
    assert [list(o.token_ids) for o in out_on] == [list(o.token_ids) for o in out_off] == references
    assert with_copies.runner.copy_orders == DEFAULT_COPY_ORDERS and without.runner.copy_orders == ()
    assert with_copies.counters.steps < 0.8 * without.counters.steps


DEPTHS = ((4, 2), (8, 2), (16, 2))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_adaptive_verifies_copies_only_within_the_draft_depth(models, prompts, references, overlap):
    """Where --draft_depths cuts the block, copies still fill all K positions; adaptive verifies no more than
    the depth per request unless ``verify_past_depth`` (then the long copies are verified, which shows
    the limit is what held them back)."""
    target, draft = models
    cheap_rows = synthetic_table(WIDTH, BUCKETS, per_row=0.0005)  # by the table, long copies pay
    limit = dict(DEPTHS)
    lengths = {}
    for past in (False, True):
        reports = []
        _, outputs = run(target, draft, prompts, "adaptive", {"verify_past_depth": past}, overlap=overlap,
                         table=cheap_rows, depths=DEPTHS, on_ready=lambda engine: engine.add_observer(reports.append))
        assert [list(o.token_ids) for o in outputs] == references
        cut = [r for r in reports if r.request_bucket in limit]
        assert cut
        lengths[past] = max(max(r.verify_lengths) - limit[r.request_bucket] for r in cut)
    assert lengths[False] <= 0 < lengths[True]


def test_only_a_policy_that_says_so_keeps_within_the_depth():
    hooks = default_hooks()
    assert not verifies_past_depth(hooks.budget_policy("adaptive", {}))
    assert verifies_past_depth(hooks.budget_policy("adaptive", {"verify_past_depth": True}))
    assert verifies_past_depth(hooks.budget_policy("fixed", {"k": 1}))  # no attribute: as before
    with pytest.raises(ConfigError, match="verify_past_depth must be true or false, got 1"):
        hooks.budget_policy("adaptive", {"verify_past_depth": 1})


def test_history_holds_prompt_and_committed_tokens(models, prompts):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2, 4, 8, 16),
                                                max_model_len=160, copy_proposals="on"))
    requests = [engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    engine.step()
    slots = {id(r): r.slot for r in requests}
    assert sorted(slots.values()) == list(range(len(prompts)))
    while engine.has_work:
        engine.step()
    storage = engine.storage
    for request, prompt in zip(requests, prompts):
        slot, tokens = slots[id(request)], prompt + list(request.output)
        assert storage.history[slot, : len(tokens)].tolist() == tokens
        assert int(storage.seq_len[slot]) >= len(tokens)  # a last step may commit past max_tokens
    engine.close()


class PlainDraft(DraftDouble):
    """A draft whose ``propose`` takes the three arguments of the protocol and nothing else."""

    def propose(self, anchors, positions, slots):
        return self.inner.propose(anchors, positions, slots)


@pytest.mark.parametrize("plain", [False, True], ids=["dspark", "plain-draft"])
def test_proposal_starts_with_the_copy_and_its_confidences(models, plain):
    """The runner's proposal from slot storage: copied tokens first, with the copy confidences;
    in static-shape mode (what a captured key records) the same, with no host read. A found copy
    fills the whole block, so a draft with nothing but the protocol's ``propose`` serves copies too."""
    target, draft = models
    draft = PlainDraft(draft) if plain else draft
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2),
                                                max_model_len=64, copy_proposals="on"))
    runner = engine.runner
    sequence = [3, 4, 5, 6, 3, 4]  # anchor 4 after 3: copy 5, 6, 3, 4, then again 5 (period 4)
    runner.prefill([sequence[:-1]], [0])
    runner.storage.start(torch.tensor([0]), torch.tensor([5]), torch.tensor([4]))
    eager_tokens, eager_conf = runner.propose_from_storage(torch.tensor([0]))
    assert eager_tokens[0].tolist() == [5, 6, 3, 4, 5]
    assert eager_conf[0].tolist() == pytest.approx([DEFAULT_COPY_CONFIDENCE] * 5)
    with static_shapes(), host_reads() as recorder:
        tokens, conf = runner._propose_fn(torch.tensor([0, runner.scratch_slot]), copies=True)
    assert not recorder.reads
    assert torch.equal(tokens[:1], eager_tokens) and torch.equal(conf[:1], eager_conf)
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_captured_keys_with_copies_equal_eager(models, prompts, references, overlap, monkeypatch):
    from dspark_core.engine.runner import ModelRunner

    target, draft = models
    # an eager step forwards only its live rows and is priced by them (test_live_pricing.py), a captured
    # one runs and is priced as its whole tier: priced alike here, the two choose the same budgets
    monkeypatch.setattr(ModelRunner, "forwards_live_rows", property(lambda self: False))
    backend = StandInCapturedBackend("cpu")
    captured, out_captured = run(target, draft, prompts, "adaptive", graphs=backend, overlap=overlap)
    eager, out_eager = run(target, draft, prompts, "adaptive", overlap=overlap)
    assert {k.stage for k in backend.keys} == {"propose", "propose+copy", "copy", "verify", "verify+context"}
    assert [list(o.token_ids) for o in out_captured] == references
    # the same proposals, so the same budgets and acceptances step by step
    assert [o.verify_widths for o in out_captured] == [o.verify_widths for o in out_eager]
    assert captured.counters.steps == eager.counters.steps


def test_switching_copies_off_and_on_in_one_engine(models, prompts, references):
    target, draft = models
    engine = Engine(target, draft, EngineConfig(draft_width=7, policy="fixed", request_buckets=BUCKETS,
                                                max_model_len=160, copy_proposals="on"))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    on = engine.generate(prompts, params)
    engine.set_copy_proposals(False)
    off = engine.generate(prompts, params)
    engine.set_copy_proposals(True)
    again = engine.generate(prompts, params)
    engine.close()
    assert [list(o.token_ids) for o in on] == [list(o.token_ids) for o in off] == references
    assert [o.steps for o in again] == [o.steps for o in on]
    assert sum(o.steps for o in on) < sum(o.steps for o in off)
    without = Engine(target, draft, EngineConfig(draft_width=7, policy="fixed", request_buckets=(1,),
                                                 max_model_len=64, copy_proposals="off"))
    with pytest.raises(ConfigError, match="cannot be turned on"):
        without.set_copy_proposals(True)
    without.close()


# -- settings --------------------------------------------------------------------------------

def test_copy_settings_follow_the_draft_config_and_the_mode(models):
    _, draft = models
    assert copy_settings(draft, "auto", 7) == ((), [])  # the random draft sets none
    assert copy_settings(draft, "on", 5) == (DEFAULT_COPY_ORDERS, [[DEFAULT_COPY_CONFIDENCE] * 5] * len(DEFAULT_COPY_ORDERS))
    assert copy_settings(None, "on", 5) == ((), [])
    rows = [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], [0.5] * 7]
    fitted = draft.config.__class__(**{**_fields(draft.config), "copy_order": 3, "copy_min_order": 2,
                                       "copy_confidences": rows})

    class Holder:
        config = fitted

        def propose(self, anchors, positions, slots):
            raise AssertionError("copy_settings only reads the config")

    assert copy_settings(Holder(), "auto", 5) == ((3, 2), [[0.9, 0.8, 0.7, 0.6, 0.5], [0.5] * 5])
    assert copy_settings(Holder(), "on", 5)[0] == (3, 2)
    assert copy_settings(Holder(), "off", 5) == ((), [])
    with pytest.raises(ConfigError, match="copy_proposals='maybe'"):
        copy_settings(draft, "maybe", 5)


def _fields(config: DraftConfig) -> dict:
    import attrs

    return attrs.asdict(config, recurse=False)


def test_draft_config_checks_and_round_trips_the_copy_fields(models, tmp_path):
    _, draft = models
    base = _fields(draft.config)
    with pytest.raises(ModelError, match="copy_order must be 0"):
        DraftConfig(**{**base, "copy_order": 9})
    with pytest.raises(ModelError, match="copy_min_order must be 1 .. copy_order"):
        DraftConfig(**{**base, "copy_order": 2, "copy_min_order": 3})
    with pytest.raises(ModelError, match=r"copy_confidences must hold 1 row\(s\).*of 7 values.*got \[2\]"):
        DraftConfig(**{**base, "copy_order": 2, "copy_confidences": [0.5, 0.5]})
    with pytest.raises(ModelError, match=r"copy_confidences must hold 2 row"):
        DraftConfig(**{**base, "copy_order": 3, "copy_min_order": 2, "copy_confidences": [[0.5] * 7]})
    with pytest.raises(ModelError, match=r"copy_confidences must lie in \(0, 1\]"):
        DraftConfig(**{**base, "copy_order": 2, "copy_confidences": [0.5] * 6 + [1.5]})
    flat = DraftConfig(**{**base, "copy_order": 2, "copy_confidences": [0.9] * 7})  # one order: a flat list will do
    assert flat.copy_orders == (2,) and flat.copy_confidences == ((0.9,) * 7,)
    config = DraftConfig(**{**base, "copy_order": 4, "copy_min_order": 2, "copy_confidences": [[0.9] * 7] * 3})
    assert config.copy_orders == (4, 3, 2)
    data = json.loads(json.dumps(config_to_speculators(config)))
    assert data["dspark_core"] == {"copy_order": 4, "copy_min_order": 2, "copy_confidences": [[0.9] * 7] * 3}
    assert config_from_speculators(data, tmp_path / "config.json") == config
    data["dspark_core"]["copy_order"] = "two"
    with pytest.raises(ModelError, match="bad value in config"):
        config_from_speculators(data, tmp_path / "config.json")


def test_copy_acceptance_counts_tries_and_hits_per_position():
    from dspark_core.train.copies import copy_acceptance

    # the sequence 1 2 3 1 | 2 3 9 1 2 3 1 (indices 0..10); anchors at 4..9, copies of 3 tokens
    prompt, answer = [1, 2, 3, 1], [2, 3, 9, 1, 2, 3, 1]
    report = copy_acceptance([(prompt, answer)], orders=(3, 2), width=3)
    # 4: key (3, 1, 2)? not before; (1, 2) at 0..1 -> copy [3, 1, 2], truth [3, 9, 1]: a hit, a miss
    # 5: (1, 2, 3) at 0..2 -> [1, 2, 3] (period 3), truth [9, ...]: a miss;  6, 7: (3, 9), (9, 1) unseen
    # 8: (9, 1, 2)? no; (1, 2) latest at 3..4 -> [3, 9, 1], truth [3, 1]: a hit, a miss
    # 9: (1, 2, 3) latest at 3..5 -> [9, 1, 2], truth [1]: a miss
    assert report["anchors"] == 6 and report["copied"] == [2, 2]
    assert report["tries"] == [[2, 0, 0], [2, 2, 0]] and report["hits"] == [[0, 0, 0], [2, 0, 0]]
    # fewer than MIN_TRIES everywhere: each cell falls back to the position before (0.5 to start)
    assert report["confidences"] == [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]


def test_bench_both_adds_a_nocopy_twin_per_drafting_policy():
    from dspark_core.commands.bench import with_and_without_copies
    from dspark_core.plugins import default_hooks

    hooks = default_hooks()
    policies = {"adaptive": hooks.budget_policy("adaptive", {}), "none": hooks.budget_policy("none", {}),
                "fixed-k3": hooks.budget_policy("fixed", {"k": 3})}
    copies = with_and_without_copies(policies)
    assert list(policies) == ["adaptive", "none", "fixed-k3", "adaptive-nocopy", "fixed-k3-nocopy"]
    assert copies == {"adaptive": True, "adaptive-nocopy": False, "none": False, "fixed-k3": True,
                      "fixed-k3-nocopy": False}
    assert policies["adaptive-nocopy"] is not policies["adaptive"]  # its own state
    with pytest.raises(ConfigError, match="'adaptive-nocopy' is already a policy"):
        with_and_without_copies({"adaptive": policies["adaptive"], "adaptive-nocopy": policies["none"]})


def test_any_draft_serves_copies_exactly(models, prompts, references):
    target, draft = models
    engine, outputs = run(target, PlainDraft(draft), prompts, "fixed", {"k": 7}, copies="on")
    assert [list(o.token_ids) for o in outputs] == references
    baseline, _ = run(target, draft, prompts, "fixed", {"k": 7}, copies="off")
    assert engine.counters.steps < 0.8 * baseline.counters.steps  # the copies were proposed and taken


# -- copy steps: the choice -------------------------------------------------------------------

WIDTH = 7


def context(costs, *, bucket=4, live=4, off=0.05, tiers=(4, 8, 12, 16)) -> TierContext:
    return TierContext(bucket, live, WIDTH, tiers, np.array(costs, dtype=np.float64), off)


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


# -- copy steps in the engine -----------------------------------------------------------------

class CountingDraft(DraftDouble):
    """The real tiny draft, counting its proposals."""

    def __init__(self, draft) -> None:
        super().__init__(draft)
        self.proposals = 0

    def propose(self, *args, **kwargs):
        self.proposals += 1
        return self.inner.propose(*args, **kwargs)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("batch", [1, 4])
def test_copy_steps_are_exact_run_no_draft_and_save_steps(models, prompts, references, batch, overlap, graphs):
    target, inner = models
    draft = CountingDraft(inner)
    backend = StandInCapturedBackend("cpu") if graphs else None
    # rows are cheap against a draft-off step: a confident copy pays
    table = draft_off_table(WIDTH, tuple(b for b in BUCKETS if b <= batch), off_seconds=0.02, per_row=0.0005)

    def serving_only(engine):  # warmup runs the proposal keys once; serving is what counts
        draft.proposals = 0

    engine, outputs = run(target, draft, prompts, NeverDrafts(copy_steps=True), batch=batch, overlap=overlap,
                          graphs=backend, table=table, on_ready=serving_only)
    assert [list(o.token_ids) for o in outputs] == references
    counters = engine.counters
    assert counters.copy_steps > 0 and counters.draft_off_steps > 0
    assert counters.copy_steps + counters.draft_off_steps == counters.steps
    # every step of every request was one or the other, and most requests had copy steps
    assert all(o.copy_steps + o.draft_off_steps == o.steps for o in outputs)
    assert sum(o.copy_steps > 0 for o in outputs) > len(outputs) // 2
    # the draft never proposed, and copy steps taught the policy nothing about it
    assert draft.proposals == 0 and engine.policy.learning.advantage == {}
    baseline, plain = run(target, inner, prompts, NeverDrafts(copy_steps=False), batch=batch, overlap=overlap,
                          table=table)
    assert [list(o.token_ids) for o in plain] == references
    assert baseline.counters.copy_steps == 0 and baseline.counters.draft_off_steps == baseline.counters.steps
    # the repeating tiny output is copied: far fewer steps than one token per request each
    assert counters.steps < 0.7 * baseline.counters.steps
