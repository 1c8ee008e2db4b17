"""Host reads inside a decode step (propose -> select_budget -> verify -> commit -> collect).

On a device every read below makes the host wait for the device, and inside a
captured graph it is not allowed at all. The step may read the device in
exactly these places, all of them the step's results or the policy's own
decision inputs:

* ``collect``: the one copy of the step's results (tokens, lengths, confidences in one tensor);
* ``select_budget`` when ``tier_lag`` is 0 (the default ``adaptive``): the tier
  is chosen on the host from this step's own confidences, so they are copied
  back between the proposal and the verify forward. This cannot go without
  changing which tier is chosen; ``tier_lag`` >= 1 decides on confidences the
  host already holds. A policy that never reads them (``fixed``, which says so
  with ``reads_confidences = False``) makes no copy;
* ``propose`` when ``tier_lag`` is 1 under schedule overlap: the early copy of
  the confidences the host is waiting for to build the next step.

Everything else (the draft's context read, the target's attention layout, the
pack kernel's fit check, the commit's masked write, the draft-context row cut,
the caps) is read-free on the captured path. The eager CPU path still sizes the
draft's and the target's attention from the batch and checks the pack fit on
the host: listed below, and gone in static-shape mode, which a captured backend
turns on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_core.device import host_to_device, stages_through_pinned_memory
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.models.row_layout import RowLayout
from dspark_kernels.accept_commit import Acceptance, commit_tokens
from capture_support import StandInCapturedBackend, device_ops_outside_replays, host_reads
from engine_support import greedy_references, random_prompts, synthetic_table, tiny_pair

WIDTH = 5
BUCKETS = (1, 2, 4)
MAX_TOKENS = 12

STEP = "dspark_core/engine/step.py"
# one copy: every result column goes back in one tensor
COLLECT = {("cpu", f"{STEP}:collect"), ("numpy", f"{STEP}:collect")}
TIER_ON_OWN_CONFIDENCES = {("cpu", f"{STEP}:select_budget"), ("numpy", f"{STEP}:select_budget")}
EARLY_PROPOSAL_COPY = {("cpu", f"{STEP}:propose"), ("numpy", f"{STEP}:propose")}
# made only by the eager path (no graph backend, or the CPU ``static`` one): they size attention from the
# batch, check the pack fit, and decide whether the verify key splits (a recorded graph computes both)
EAGER_ONLY = {("tolist", "dspark_core/models/dspark_draft.py:backbone"),
              ("tolist", "dspark_core/models/row_layout.py:build"),
              ("_local_scalar_dense", "kernels/pack.py:pack"),
              ("_local_scalar_dense", "dspark_core/engine/runner.py:_verify_fn")}  # split in the key or not


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=3)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=5)


@pytest.fixture(scope="module")
def references(models, prompts):
    return greedy_references(models[0], prompts, MAX_TOKENS)


def recorded_run(models, prompts, references, policy, options, *, overlap, captured):
    """Generate with every decode step's device work recorded; returns the set of reads and the engine."""
    target, draft = models
    graphs = StandInCapturedBackend("cpu") if captured else None
    # the real draft (test doubles that fake good drafts read the host themselves)
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy=policy, policy_options=options,
                                                request_buckets=BUCKETS, max_model_len=96, schedule_overlap=overlap),
                    graphs=graphs)
    engine.install_table(synthetic_table(WIDTH, BUCKETS))
    if captured:
        engine.warmup()
        engine.mark_ready()
    reads: set[tuple[str, str]] = set()
    engine.result_copies = 0  # the collect stage's device-to-host copies, over all steps
    engine.outside_replays = []  # (aten op, project frames) of device work outside graph replays
    device_decode = engine.decode_on_device

    def recorded(step):
        with host_reads() as recorder, device_ops_outside_replays() as outside:
            result = device_decode(step)
        reads.update(recorder.reads)
        engine.result_copies += recorder.reads.count(("cpu", f"{STEP}:collect"))
        engine.outside_replays += outside.ops
        return result

    engine.decode_on_device = recorded
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.close()
    assert [list(o.token_ids) for o in outputs] == references
    assert engine.counters.steps > 0
    return reads, engine


CASES = [  # policy, options, overlap, reads allowed besides the result copy
    ("adaptive", {"tier_lag": 2}, True, set()),
    ("adaptive", {"tier_lag": 1}, False, set()),
    ("adaptive", {"tier_lag": 1}, True, EARLY_PROPOSAL_COPY),
    ("adaptive", {"tier_lag": 0}, True, TIER_ON_OWN_CONFIDENCES),
    ("fixed", {}, False, set()),  # tier_lag 0, but fixed does not read confidences: nothing to wait for
    ("fixed", {}, True, set()),
    ("none", {}, True, set()),
]


@pytest.mark.parametrize("policy,options,overlap,allowed", CASES,
                         ids=[f"{c[0]}-lag{c[1].get('tier_lag', 0)}-{'overlap' if c[2] else 'sync'}" for c in CASES])
def test_captured_step_reads_only_its_results_and_the_policy_inputs(models, prompts, references, policy, options,
                                                                    overlap, allowed):
    reads, engine = recorded_run(models, prompts, references, policy, options, overlap=overlap, captured=True)
    assert reads == COLLECT | allowed
    assert engine.result_copies == engine.counters.steps  # one copy per step


# Work a captured step may still launch one op at a time outside its two graph keys (proposal with
# its anchors and record in slot storage; the allocate split, verify, accept, context and commit):
# staging the keys' inputs, a policy's own split (fixed's clamp), the result copy, and the
# draft-context write of rows that a prefill or a bucket-tier step queued (written before the next
# proposal, not inside a key)
INSIDE_KEYS_ONLY = ("dspark_core/models/llama.py:", "dspark_core/models/dspark_draft.py:propose",
                    "dspark_core/models/dspark_draft.py:backbone", "kernels/pack.py:", "kernels/accept_commit.py:",
                    "kernels/allocate.py:",
                    "dspark_core/engine/slots.py:commit", "dspark_core/engine/slots.py:anchors",
                    "dspark_core/engine/slots.py:record_proposal", "dspark_core/engine/runner.py:_verify_fn",
                    "dspark_core/engine/runner.py:_propose_fn")
QUEUED_CONTEXT = "dspark_core/engine/draft_context.py:flush"


@pytest.mark.parametrize("policy,options", [("adaptive", {"tier_lag": 2}), ("fixed", {}), ("none", {})],
                         ids=["adaptive-lag2", "fixed", "none"])
def test_captured_step_runs_models_kernels_and_commit_inside_its_graph_keys(models, prompts, references, policy,
                                                                           options):
    _, engine = recorded_run(models, prompts, references, policy, options, overlap=False, captured=True)
    assert engine.outside_replays
    # the recorder sees who launched each op: the step's own frames show on the ops it runs outside the keys
    assert any("dspark_core/engine/step.py:run" in frames for _, frames in engine.outside_replays)
    for op, frames in engine.outside_replays:
        inside = sorted(f for f in frames if f.startswith(INSIDE_KEYS_ONLY))
        assert not inside, f"{op} ran outside the graph keys, from {inside}"
        if any(f.startswith("dspark_core/models/") for f in frames):  # model work: only the queued rows
            assert QUEUED_CONTEXT in frames, f"{op} ran model code outside the keys: {sorted(frames)}"


def test_eager_step_also_sizes_attention_on_the_host(models, prompts, references):
    """Without a captured backend the step reads the batch's sizes; the recorder sees each of them."""
    reads, _ = recorded_run(models, prompts, references, "adaptive", {"tier_lag": 1}, overlap=False, captured=False)
    assert reads == COLLECT | EAGER_ONLY


def commit_reference(output_tokens, output_lengths, slots, acceptance):
    for r, slot in enumerate(slots.tolist()):
        start, count = int(output_lengths[slot]), int(acceptance.accepted[r]) + 1
        for j in range(count):
            if start + j < output_tokens.shape[1]:
                output_tokens[slot, start + j] = acceptance.committed[r, j]
        output_lengths[slot] = start + count


def test_read_free_commit_equals_the_masked_write():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        slots = torch.randperm(6, generator=g)[: 1 + trial % 5]
        n, length = slots.shape[0], 9
        tokens = torch.randint(1, 50, (7, length), generator=g)
        lengths = torch.randint(0, length + 3, (7,), generator=g)  # some at or past the end of the buffer
        acceptance = Acceptance(torch.randint(0, WIDTH + 1, (n,), generator=g),
                                torch.randint(50, 99, (n, WIDTH + 1), generator=g))
        want_tokens, want_lengths = tokens.clone(), lengths.clone()
        commit_reference(want_tokens, want_lengths, slots, acceptance)
        with host_reads() as recorder:
            commit_tokens(tokens, lengths, slots, acceptance)
        assert recorder.reads == []
        assert torch.equal(tokens, want_tokens) and torch.equal(lengths, want_lengths)


def test_row_layout_unpad_is_a_plain_gather():
    positions = torch.tensor([5, 6, 7, 2, 0, 1, 2])
    layout = RowLayout.build(positions, torch.tensor([0, 2, 1, 3]), torch.tensor([0, 3, 4, 4, 7]),
                             max_rows=7, kv_len=16)
    padded = torch.randn(4, 7, 3)
    with host_reads() as recorder:
        rows = layout.unpad(padded)
    assert recorder.reads == []
    assert torch.equal(rows, padded[layout.valid])  # the boolean-mask form it replaces
    assert torch.equal(layout.unpad(layout.pad(positions)), positions)


def test_step_inputs_reach_a_cuda_device_through_pinned_memory_without_waiting(monkeypatch):
    """Host-built step inputs (slots, caps, prefill rows): a plain copy on CPU; on CUDA and NPU, pinned
    memory and a non-blocking copy (a pageable copy would make the host wait for the previous step)."""
    on_cpu = host_to_device(np.array([3, 1, 2]), "cpu")
    assert on_cpu.dtype == torch.int64 and on_cpu.tolist() == [3, 1, 2]
    assert not stages_through_pinned_memory("cpu") and stages_through_pinned_memory("cuda:1")
    assert stages_through_pinned_memory(torch.device("cuda", 0)) and not stages_through_pinned_memory(torch.device("cpu"))
    assert stages_through_pinned_memory("npu") and stages_through_pinned_memory("npu:3")  # no torch_npu needed
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin",)) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: calls.append(("to", args, kwargs)) or self)
    host_to_device([5, 6], "cuda:0")
    assert calls == [("pin",), ("to", ("cuda:0",), {"non_blocking": True})]
