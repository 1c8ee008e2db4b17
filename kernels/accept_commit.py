"""Kernel 3, accept/commit: greedy acceptance and the write into slot storage.

The target's greedy token at request r's row i (row 0 is the anchor) is the
correct continuation after the anchor and drafts 1..i. Draft i+1 is accepted
while it equals that token; the first mismatch (or the end of the verified
prefix) ends acceptance, and the target's token there is the bonus. Because
accepted drafts equal the target's tokens, the committed tokens are exactly
the target's greedy tokens at rows 0..accepted, which is why greedy output
never depends on the budget.
"""

from __future__ import annotations

import torch
from attrs import frozen


@frozen
class Acceptance:
    """Per request: drafts accepted, and the committed tokens (accepted + bonus)."""

    accepted: torch.Tensor  # [B] int64, 0..lengths[r]
    committed: torch.Tensor  # [B, K+1] int64, first accepted+1 entries valid


def gather_target_tokens(target_tokens: torch.Tensor, row_offsets: torch.Tensor, width: int) -> torch.Tensor:
    """Turn packed per-row greedy tokens [G] into a [B, K+1] grid (cells past a request's rows are junk)."""
    column = torch.arange(width + 1, device=target_tokens.device)
    index = (row_offsets[:-1].unsqueeze(1) + column.unsqueeze(0)).clamp(max=target_tokens.shape[0] - 1)
    return target_tokens[index]


def accept_reference(drafts: torch.Tensor, lengths: torch.Tensor, target_grid: torch.Tensor) -> Acceptance:
    """Loop reference of greedy acceptance."""
    batch, width = drafts.shape
    accepted = torch.zeros(batch, dtype=torch.int64, device=drafts.device)
    committed = torch.zeros(batch, width + 1, dtype=torch.int64, device=drafts.device)
    for r in range(batch):
        n = 0
        while n < int(lengths[r]) and int(drafts[r, n]) == int(target_grid[r, n]):
            n += 1
        accepted[r] = n
        committed[r, : n + 1] = target_grid[r, : n + 1]
    return Acceptance(accepted, committed)


def make_accept(width: int):
    """Width-specialised acceptance: the first mismatch as a masked min over K."""

    def accept(drafts: torch.Tensor, lengths: torch.Tensor, target_grid: torch.Tensor) -> Acceptance:
        if drafts.shape[1] != width:
            raise ValueError(f"accept kernel for K={width} got drafts of width {drafts.shape[1]}")
        column = torch.arange(width + 1, device=drafts.device).unsqueeze(0)  # [1, K+1], shared by both masks
        drafted = column[:, :width]
        # acceptance stops at the first draft the target disagrees with, or past the verified prefix
        stop = (drafts != target_grid[:, :width]) | (drafted >= lengths.unsqueeze(1))
        # the first stop's column, or K when every draft is accepted: a min over [B, K], no running product
        # (K = 0, target-only decoding: nothing to accept, and nothing to take a min over)
        accepted = torch.where(stop, drafted, width).amin(dim=1) if width else lengths.new_zeros(drafts.shape[0])
        committed = torch.where(column <= accepted.unsqueeze(1), target_grid, 0)
        return Acceptance(accepted, committed)

    accept.__name__ = f"accept_k{width}"
    return accept


def commit_tokens(output_tokens: torch.Tensor, output_lengths: torch.Tensor, slots: torch.Tensor,
                  acceptance: Acceptance) -> None:
    """Append each request's committed tokens to its slot's output buffer, in place.

    ``output_tokens`` is slot storage [S, L]; ``output_lengths`` [S] advances by
    accepted + 1. Writes past L are dropped (the engine stops a request before).

    Fixed shape and no host read: every cell of the [B, K+1] window is written,
    cells past the committed tokens with the value already there. Columns past
    L are folded onto column L-1, and each written value depends only on its
    destination cell, so cells that collide write the same value.
    """
    width_plus_one = acceptance.committed.shape[1]
    count = acceptance.accepted + 1
    column = torch.arange(width_plus_one, device=output_tokens.device)
    start = output_lengths[slots]
    cols = (start.unsqueeze(1) + column.unsqueeze(0)).clamp(max=output_tokens.shape[1] - 1)
    rows = slots.unsqueeze(1).expand_as(cols)
    offset = cols - start.unsqueeze(1)  # index into the committed tokens of the destination column
    new = (offset >= 0) & (offset < count.unsqueeze(1))
    committed = acceptance.committed.gather(1, offset.clamp(min=0, max=width_plus_one - 1))
    output_tokens[rows, cols] = torch.where(new, committed, output_tokens[rows, cols])
    output_lengths[slots] = start + count
