"""One-row cells (dspark_core.models.row_cells): static forwards of one-row-per-request batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_core.graphs import static_shapes
from dspark_core.models import row_layout
from dspark_core.models.base import ForwardBatch, make_forward_batch
from dspark_core.models.random_models import random_target, tiny_target_config
from dspark_core.models.row_cells import OneRowCells

VARIANTS = {
    "llama": tiny_target_config(),  # fused rotary over query, key and value heads
    "qwen3": tiny_target_config(architecture="qwen3", qk_norm=True, num_kv_heads=1),  # keys normed apart
}
SLOTS = 6  # the last one is the scratch (padding) slot


@pytest.fixture(scope="module", params=[(name, invariant) for name in sorted(VARIANTS) for invariant in (False, True)],
                ids=lambda p: f"{p[0]}-{'invariant' if p[1] else 'default'}")
def model(request):
    name, invariant = request.param
    return random_target(VARIANTS[name], seed=13, batch_invariant=invariant)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_one_row_cells_give_live_rows_their_eager_results_and_touch_no_other_slot(model, data):
    """A static forward of one row per request computes the rows in cells (no gathers per layer). Live
    rows get the eager forward's logits and hidden states, bit for bit where forwards are
    batch-invariant; the keys and values of every slot but the scratch slot are what the eager forward
    leaves, so a slot whose request is not in the batch (one still prefilling) keeps its context, and
    so does the slot of an empty bucket entry."""
    in_place = data.draw(st.booleans(), label="read in place")
    order = data.draw(st.permutations(range(SLOTS - 1)), label="slots")
    live = data.draw(st.integers(1, SLOTS - 1), label="live requests")
    empty = data.draw(st.integers(0, 2), label="empty entries")
    padding_rows = data.draw(st.integers(0, 3), label="padding rows")
    padding_last = data.draw(st.booleans(), label="padding request left out")
    contexts = [data.draw(st.lists(st.integers(0, 96), min_size=1, max_size=9), label=f"context{s}") for s in range(SLOTS - 1)]
    cache = model.new_cache(SLOTS, 24)
    model.forward(make_forward_batch(contexts, [0] * (SLOTS - 1), list(range(SLOTS - 1))), cache)
    slots = list(order[:live])
    tokens = [(11 * s + 3) % 90 for s in slots] + [0] * padding_rows
    positions = [len(contexts[s]) for s in slots] + [0] * padding_rows
    # the live entries, empty entries on the scratch slot, then the padding request there
    slot_ids = slots + [SLOTS - 1] * (empty + 1)
    offsets = list(range(live + 1)) + [live] * empty + [live + padding_rows]
    batch = ForwardBatch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slot_ids), torch.tensor(offsets),
                         padding_slot=SLOTS - 1, max_request_rows=1, padding_last=padding_last)
    before = cache.kv.clone()
    eager = model.forward(make_forward_batch([[t] for t in tokens[:live]], positions[:live], slots), cache, hidden_layers=(1,))
    eager_kv = cache.kv.clone()
    cache.kv.copy_(before)
    built = []
    build = OneRowCells.build
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OneRowCells, "build", classmethod(lambda cls, *a, **k: built.append(build(*a, **k)) or built[-1]))
        patch.setattr(row_layout, "_MAX_WINDOW_SLOTS_PER_REQUEST", SLOTS if in_place else 0)
        with static_shapes():
            static = model.forward(batch, cache, hidden_layers=(1,))
    cells = built[0]
    assert cells.layout.first_slot == (0 if in_place else None)
    # no cell for the scratch slot, nor, when the batch says it is last, for the padding request
    assert cells.row_of_cell.shape[0] == (SLOTS - 1 if in_place else len(slot_ids) - padding_last)
    # (other forwards differ in the last bits between batch shapes; a wrong cell would differ by far more)
    compare = torch.equal if model.batch_invariant else (
        lambda a, b: torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4) is None)
    assert compare(static.logits[:live], eager.logits)
    assert compare(static.hidden[:live], eager.hidden)
    assert compare(cache.kv[:, :, : SLOTS - 1], eager_kv[:, :, : SLOTS - 1])
    assert torch.isfinite(static.logits).all()  # padding rows read back a cell's result


def test_cells_of_an_in_place_read_skip_the_scratch_slot_and_send_idle_writes_there():
    """Slots 0 and 2 hold rows, slot 1 is idle, slot 3 is the scratch slot with two padding rows: three
    cells; the idle cell writes to the scratch slot; the padding rows read back cell 0."""
    cells = OneRowCells.build(torch.tensor([7, 4, 0, 0]), torch.tensor([2, 0, 3]), torch.tensor([0, 1, 2, 4]),
                              kv_len=8, padding_slot=3, window_slots=3)
    assert cells.row_of_cell.tolist() == [1, 0, 0]
    assert cells.layout.valid[:, 0].tolist() == [True, False, True]
    assert cells.layout.slot_of_row.tolist() == [0, 3, 2]
    assert cells.positions.tolist() == [4, 0, 7]
    assert cells.cell_of_row.tolist() == [2, 0, 0, 0]


def test_cells_of_gathered_keys_are_the_requests():
    """Without an in-place read the cells are the requests: an empty entry writes to the padding slot,
    and the padding request computes its first row, which its other rows read back."""
    cells = OneRowCells.build(torch.tensor([7, 4, 0, 0]), torch.tensor([5, 1, 9, 9]), torch.tensor([0, 1, 2, 2, 4]),
                              kv_len=8, padding_slot=9, window_slots=None)
    assert cells.row_of_cell.tolist() == [0, 1, 0, 2]
    assert cells.layout.slot_of_row.tolist() == [5, 1, 9, 9]
    assert cells.positions.tolist() == [7, 4, 0, 0]
    assert cells.cell_of_row.tolist() == [0, 1, 3, 3]


def test_gathered_cells_leave_out_a_padding_request_the_batch_puts_last():
    """With ``padding_last`` the padding request gets no cell: one request of a bucket of one is one cell,
    whose keys alone are gathered, and the padding rows read back the cell before."""
    cells = OneRowCells.build(torch.tensor([7, 4, 0, 0]), torch.tensor([5, 1, 9, 9]), torch.tensor([0, 1, 2, 2, 4]),
                              kv_len=8, padding_slot=9, window_slots=None, padding_last=True)
    assert cells.row_of_cell.tolist() == [0, 1, 0]
    assert cells.layout.slot_of_row.tolist() == [5, 1, 9]
    assert cells.cell_of_row.tolist() == [0, 1, 2, 2]
    one = OneRowCells.build(torch.tensor([3, 0]), torch.tensor([4, 9]), torch.tensor([0, 1, 2]), kv_len=8, padding_slot=9,
                            window_slots=None, padding_last=True)
    assert one.row_of_cell.tolist() == [0] and one.cell_of_row.tolist() == [0, 0]
