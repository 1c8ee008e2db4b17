"""Each kernel's width-specialised variant equals its reference on random inputs, ties included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_kernels import SPECIALISED_WIDTHS, accept_reference, allocate_reference, kernels_for, pack_reference
from dspark_kernels.accept_commit import commit_tokens, gather_target_tokens
from dspark_kernels.allocate import survival

# Confidences drawn from a small set so equal survivals (ties) are common.
TIE_VALUES = [0.0, 0.25, 0.5, 0.5, 1.0, 1.0, 0.9]


@st.composite
def allocation_case(draw, width):
    batch = draw(st.integers(1, 6))
    tie_heavy = draw(st.booleans())
    if tie_heavy:
        values = draw(st.lists(st.sampled_from(TIE_VALUES), min_size=batch * width, max_size=batch * width))
    else:
        values = draw(st.lists(st.floats(0, 1), min_size=batch * width, max_size=batch * width))
    caps = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    rows = draw(st.integers(0, batch * width + 3))
    return torch.tensor(values).reshape(batch, width), torch.tensor(caps), rows


def _check_allocation(conf, caps, rows, lengths):
    width = conf.shape[1]
    assert lengths.dtype == torch.int64
    assert bool((lengths <= caps).all()) and bool((lengths >= 0).all())
    assert int(lengths.sum()) == min(rows, int(caps.clamp(max=width).sum()))
    # chosen survivals are a top-m set over the allowed positions
    surv = survival(conf)
    allowed = [(float(surv[r, j]), r, j) for r in range(conf.shape[0]) for j in range(int(caps[r]))]
    best = sorted((v for v, _, _ in allowed), reverse=True)[: int(lengths.sum())]
    chosen = sum(float(surv[r, j]) for r in range(conf.shape[0]) for j in range(int(lengths[r])))
    assert abs(chosen - sum(best)) < 1e-5


@settings(max_examples=150, deadline=None)
@given(data=st.data(), width=st.sampled_from(SPECIALISED_WIDTHS))
def test_allocate_matches_reference(data, width):
    conf, caps, rows = data.draw(allocation_case(width))
    expected = allocate_reference(conf, caps, rows)
    got = kernels_for(width).allocate(conf, caps, rows)
    assert torch.equal(got, expected)
    _check_allocation(conf, caps, rows, got)


def test_allocate_ties_break_by_position_then_request():
    # all survivals equal: three rows go to position 1 of requests 0,1,2 before any position 2
    conf = torch.ones(3, 5)
    for kernel in (allocate_reference, kernels_for(5).allocate):
        assert kernel(conf, torch.full((3,), 5), 4).tolist() == [2, 1, 1]


@st.composite
def pack_case(draw, width):
    batch = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    starts = draw(st.lists(st.integers(0, 50), min_size=batch, max_size=batch))
    extra = draw(st.integers(0, 6))
    drafts = torch.randint(0, 1000, (batch, width))
    anchors = torch.randint(0, 1000, (batch,))
    slots = torch.randperm(8)[:batch]
    tier = sum(lengths) + batch + extra
    return anchors, drafts, torch.tensor(lengths), torch.tensor(starts), slots, tier


@settings(max_examples=100, deadline=None)
@given(data=st.data(), width=st.sampled_from(SPECIALISED_WIDTHS))
def test_pack_matches_reference(data, width):
    case = data.draw(pack_case(width))
    expected = pack_reference(*case, pad_slot=99, pad_token=7)
    got = kernels_for(width).pack(*case, pad_slot=99, pad_token=7)
    for name in ("tokens", "positions", "row_slots", "row_offsets"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.tokens.shape[0] == case[-1]


@st.composite
def accept_case(draw, width):
    batch = draw(st.integers(1, 6))
    lengths = torch.tensor(draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch)))
    target = torch.randint(0, 4, (batch, width + 1))
    # drafts agree with the target on a random prefix, then may or may not
    agree = torch.tensor(draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch)))
    drafts = torch.randint(0, 4, (batch, width))
    mask = torch.arange(width).unsqueeze(0) < agree.unsqueeze(1)
    drafts = torch.where(mask, target[:, :width], drafts)
    return drafts, lengths, target


@settings(max_examples=150, deadline=None)
@given(data=st.data(), width=st.sampled_from(SPECIALISED_WIDTHS))
def test_accept_matches_reference(data, width):
    drafts, lengths, target = data.draw(accept_case(width))
    expected = accept_reference(drafts, lengths, target)
    got = kernels_for(width).accept(drafts, lengths, target)
    assert torch.equal(got.accepted, expected.accepted)
    assert torch.equal(got.committed, expected.committed)
    assert bool((got.accepted <= lengths).all())


def test_commit_appends_into_slot_storage_and_gather_reads_rows():
    width = 5
    out = torch.zeros(4, 10, dtype=torch.int64)
    lengths = torch.tensor([0, 3, 0, 9])
    slots = torch.tensor([1, 3])
    drafts = torch.tensor([[5, 6, 7, 8, 9], [1, 1, 1, 1, 1]])
    packed_target = torch.tensor([5, 6, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # request 0: rows 0..5, request 1: rows 6..11
    grid = gather_target_tokens(packed_target, torch.tensor([0, 6, 12]), width)
    acc = kernels_for(width).accept(drafts, torch.tensor([5, 5]), grid)
    assert acc.accepted.tolist() == [2, 0]
    commit_tokens(out, lengths, slots, acc)
    assert out[1, 3:6].tolist() == [5, 6, 0]
    assert out[3, 9].item() == 2  # second token would fall off the buffer and is dropped
    assert lengths.tolist() == [0, 6, 0, 10]
