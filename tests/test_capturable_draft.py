"""The draft proposal in static-shape mode (what graph capture records) equals the eager proposal,
and the proposal runs through the graph backend per request bucket."""

from __future__ import annotations

import pytest
import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.engine.runner import ModelRunner
from dspark_core.geometry import Geometry
from dspark_core.graphs import static_shapes
from dspark_core.models.random_models import random_draft, random_target, tiny_target_config
from dspark_plugins.graphs.static import EagerStaticBackend
from capture_support import StandInCapturedBackend, host_reads
from engine_support import greedy_references, random_prompts

CFG = tiny_target_config(max_position=256)


@pytest.fixture(scope="module")
def target():
    return random_target(CFG, seed=7, dtype=torch.float64)


def filled_draft(target, *, num_slots: int, max_len: int, seed: int, **variant):
    """A draft whose context cache holds random keys/values at every position of every slot, so a
    proposal that attended past its anchor (stale rows) would come out different."""
    draft = random_draft(CFG, seed=seed, **variant).to(torch.float64).bind_target(target)
    draft.allocate_context(num_slots, max_len)
    g = torch.Generator().manual_seed(seed)
    width = len(draft.config.aux_layer_ids) * CFG.hidden_size
    for slot in range(num_slots):
        hidden = torch.randn(max_len, width, generator=g, dtype=torch.float64)
        draft.extend_context(hidden, torch.arange(max_len), torch.full((max_len,), slot))
    return draft


def batch(num_slots: int, max_len: int, seed: int, size: int):
    """Anchors at positions that differ per slot: an empty context (0), a full one (max_len), others."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:size]
    positions = torch.randint(0, max_len + 1, (size,), generator=g)
    positions[0] = max_len
    if size > 1:
        positions[1] = 0
    anchors = torch.randint(0, CFG.vocab_size, (size,), generator=g)
    return anchors, positions, slots


@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("max_len", [12, 64])
@pytest.mark.parametrize("variant", [dict(), dict(markov_head_type="rnn", draft_vocab_size=40, num_layers=2)],
                         ids=["vanilla", "rnn-subset"])
def test_static_shape_proposal_equals_eager(target, size, max_len, variant):
    draft = filled_draft(target, num_slots=8, max_len=max_len, seed=size + max_len, **variant)
    anchors, positions, slots = batch(8, max_len, seed=size, size=size)
    eager_tokens, eager_conf = draft.propose(anchors, positions, slots)
    with static_shapes(), host_reads() as recorder:
        static_tokens, static_conf = draft.propose(anchors, positions, slots)
    assert recorder.reads == []  # nothing read back, nothing sized from data: capturable
    assert torch.equal(static_tokens, eager_tokens)
    torch.testing.assert_close(static_conf, eager_conf, rtol=0, atol=1e-6)
    # per slot: the same block as when the slot is drafted alone (other contexts do not leak in)
    for row in range(size):
        alone_tokens, _ = draft.propose(anchors[row : row + 1], positions[row : row + 1], slots[row : row + 1])
        assert torch.equal(alone_tokens[0], static_tokens[row])


@pytest.mark.parametrize("variant", [dict(), dict(markov_head_type="rnn", draft_vocab_size=40, num_layers=2)],
                         ids=["vanilla", "rnn-subset"])
def test_eager_proposals_reading_the_context_in_place_equal_gathered_ones(target, variant, monkeypatch):
    """With the padding slot known, a batch whose live slots fill a run of the context cache (slots
    0-4 in any order, padding entries on the scratch slot 7) computes its blocks in slot order and
    reads the context in place: the proposals of the gathered read (a static proposal, which always
    gathers), and every entry its own (a mix-up of cells would hand one request another's block)."""
    from dspark_core.models.context_cells import ContextCells

    draft = filled_draft(target, num_slots=8, max_len=40, seed=5, **variant)
    g = torch.Generator().manual_seed(2)
    slots = torch.cat([torch.randperm(5, generator=g), torch.tensor([7, 7])])  # 5 live, 2 padding
    positions = torch.randint(1, 41, (7,), generator=g)
    anchors = torch.randint(0, CFG.vocab_size, (7,), generator=g)
    draft.padding_slot = 7
    with static_shapes():
        gathered = draft.propose(anchors, positions, slots)
    built = []
    eager = ContextCells.eager
    monkeypatch.setattr(ContextCells, "eager", classmethod(lambda cls, *a, **k: built.append(eager(*a, **k)) or built[-1]))
    in_place = draft.propose(anchors, positions, slots)
    assert built[0] is not None and built[0].count == 5
    assert torch.equal(in_place[0][:5], gathered[0][:5])
    torch.testing.assert_close(in_place[1][:5], gathered[1][:5], rtol=0, atol=1e-6)
    assert torch.isfinite(in_place[1]).all()  # padding entries read back a cell's block


def test_a_training_forward_gathers_its_context_so_later_cache_writes_leave_its_backward_alone(target):
    """``forward_block`` (gradients on) on slots that a proposal would read in place: the block still
    reads a gathered copy, so writing the context before ``backward`` (as the next step's rows do)
    cannot invalidate the saved tensors."""
    draft = filled_draft(target, num_slots=4, max_len=16, seed=2)
    draft.padding_slot = 3
    tokens = torch.randint(0, CFG.vocab_size, (3, draft.config.num_speculative_tokens))
    out = draft.forward_block(tokens, torch.tensor([5, 9, 12]), torch.tensor([0, 1, 2]))
    width = len(draft.config.aux_layer_ids) * CFG.hidden_size
    draft.extend_context(torch.randn(3, width, dtype=torch.float64), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    out.logits.sum().backward()
    grad = draft.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_context_cells_fall_back_to_gathering_where_reading_in_place_does_not_pay():
    """Repeated live slots or a run longer than the batch gather; padding entries read back cell 0,
    and an idle slot inside the run is a cell without an entry."""
    from dspark_core.models.context_cells import ContextCells

    cpu = torch.device("cpu")
    assert ContextCells.eager([3, 3], None, cpu) is None
    assert ContextCells.eager([0, 3], None, cpu) is None  # 4 slots for 2 entries
    in_order = ContextCells.eager([3, 4, 5], None, cpu)  # entry i on slot 3 + i: views, nothing to reorder
    assert (in_order.first_slot, in_order.count, in_order.entry_of_cell, in_order.cell_of_entry) == (3, 3, None, None)
    cells = ContextCells.eager([4, 2, 9, 9], 9, cpu)  # slots 2-4, slot 3 idle, two padding entries
    assert (cells.first_slot, cells.entry_of_cell.tolist(), cells.holds_entry.tolist(), cells.cell_of_entry.tolist()) \
        == (2, [1, 0, 0], [True, False, True], [2, 0, 0, 0])


def test_eager_proposal_reads_the_host_and_static_does_not(target):
    """The recorder sees the eager context sizing (so the assertion above can fail)."""
    draft = filled_draft(target, num_slots=2, max_len=12, seed=1)
    anchors, positions, slots = batch(2, 12, seed=1, size=2)
    with host_reads() as recorder:
        draft.propose(anchors, positions, slots)
    assert ("tolist", "dspark_core/models/dspark_draft.py:backbone") in recorder.reads


@pytest.mark.parametrize("backend_class", [EagerStaticBackend, StandInCapturedBackend], ids=["static", "captured"])
def test_runner_proposes_through_the_backend_per_bucket(target, backend_class):
    draft = filled_draft(target, num_slots=4, max_len=32, seed=3, block_size=7)
    backend = backend_class("cpu")
    runner = ModelRunner(target, draft, draft_width=5, num_slots=4, max_len=32, graphs=backend)
    # the draft learns which context slot holds padding entries: eagerly the bucket below then reads the
    # context in place (slots 0-3, slot 1 idle) where the unpadded proposal gathers (4 slots, 3 entries)
    assert draft.padding_slot == runner.scratch_slot == 4
    # the runner allocated a fresh context: fill it again (the scratch slot 4 too)
    g = torch.Generator().manual_seed(3)
    width = len(draft.config.aux_layer_ids) * CFG.hidden_size
    for slot in range(5):
        draft.extend_context(torch.randn(32, width, generator=g, dtype=torch.float64), torch.arange(32),
                             torch.full((32,), slot))
    runner.warmup(Geometry.all_tiers(5, (1, 2, 4)))
    assert {k.request_bucket for k in backend.keys if k.stage == "propose"} == {1, 2, 4}
    backend.seal()
    anchors, positions, slots = torch.tensor([3, 9, 20]), torch.tensor([17, 0, 31]), torch.tensor([2, 0, 3])
    want_tokens, want_conf = runner.propose(anchors, positions, slots)  # eager, explicit anchors
    # the engine's path: anchors read from slot storage inside the bucket's key, the block recorded there
    runner.storage.last_token[slots], runner.storage.seq_len[slots] = anchors, positions + 1
    before = backend.counters.replays
    tokens, conf = runner.propose_from_storage(slots, request_bucket=4)  # padded with one scratch row
    assert backend.counters.replays == before + 1
    assert tokens.shape == (3, 5) and torch.equal(tokens, want_tokens)
    torch.testing.assert_close(conf, want_conf, rtol=0, atol=1e-6)
    assert torch.equal(runner.storage.draft_tokens[slots], want_tokens)
    # eagerly from slot storage (no bucket): the same block
    assert torch.equal(runner.propose_from_storage(slots)[0], want_tokens)


@pytest.mark.parametrize("attention", ["auto", "matmul"])  # matmul: what CUDA decode steps run
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_on_a_captured_backend_is_exact(target, overlap, attention):
    """The whole engine on the captured-backend stand-in (proposal and verify replayed from static
    buffers in static-shape mode) gives target-only greedy output and prepares nothing after ready."""
    from dspark_core.models.attention import set_attention_kernel

    draft = random_draft(CFG, seed=5, block_size=7).to(torch.float64)
    backend = StandInCapturedBackend("cpu")
    set_attention_kernel(attention)
    try:
        engine = Engine(target, draft, EngineConfig(draft_width=5, policy="fixed", request_buckets=(1, 2, 4),
                                                    max_model_len=96, schedule_overlap=overlap), graphs=backend)
        engine.warmup()
        engine.mark_ready()
        captures = backend.counters.captures
        assert captures == len(backend.keys)
        assert {k.stage for k in backend.keys} == {"propose", "verify", "verify+context"}
        prompts = random_prompts(3, seed=9)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        engine.close()
    finally:
        set_attention_kernel("auto")
    assert [list(o.token_ids) for o in outputs] == greedy_references(target, prompts, 10)
    assert backend.counters.captures == captures
    assert backend.counters.replays == 2 * engine.counters.steps  # a proposal and a verify per step
