"""Kernel 2, pack: lay out a tier's target rows.

Request r contributes its anchor (the last committed token, at position
``start[r]``) followed by its first ``lengths[r]`` drafted tokens. Rows are
request-major and padded to exactly ``tier_rows`` so the verify forward always
has a captured shape. Padding rows (bucket slots without a request, and rows
the budget left unused) are given to the scratch KV slot ``pad_slot``, all at
position 0: their writes there harm nothing, they fit a cache of any length
(a tier can have more rows than the cache has positions), and they do not
widen the keys a forward reads.
"""

from __future__ import annotations

import torch
from attrs import frozen

from dspark_core.graphs import static_shapes_active


@frozen
class PackedRows:
    """A packed verify batch: ``row_offsets[r]:row_offsets[r+1]`` are request r's rows."""

    tokens: torch.Tensor  # [G] int64
    positions: torch.Tensor  # [G] int64
    row_slots: torch.Tensor  # [G] int64, KV slot of every row
    row_offsets: torch.Tensor  # [B+1] int64


def pack_reference(anchors: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
                   slots: torch.Tensor, tier_rows: int, pad_slot: int, pad_token: int = 0) -> PackedRows:
    """Straightforward loop over requests (the portable reference)."""
    tokens, positions, row_slots, offsets = [], [], [], [0]
    for r in range(anchors.shape[0]):
        n = int(lengths[r])
        tokens += [int(anchors[r])] + [int(t) for t in drafts[r, :n]]
        positions += list(range(int(starts[r]), int(starts[r]) + n + 1))
        row_slots += [int(slots[r])] * (n + 1)
        offsets.append(offsets[-1] + n + 1)
    pad = tier_rows - len(tokens)
    if pad < 0:
        raise ValueError(f"{len(tokens)} rows do not fit tier {tier_rows}")
    tokens += [pad_token] * pad
    positions += [0] * pad
    row_slots += [pad_slot] * pad
    device = anchors.device
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return PackedRows(as_long(tokens), as_long(positions), as_long(row_slots), as_long(offsets))


def make_pack(width: int):
    """Width-specialised pack: write a static [B, K+1] grid into the tier's rows."""

    def pack(anchors: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
             slots: torch.Tensor, tier_rows: int, pad_slot: int, pad_token: int = 0) -> PackedRows:
        if drafts.shape[1] != width:
            raise ValueError(f"pack kernel for K={width} got drafts of width {drafts.shape[1]}")
        device = anchors.device
        batch = anchors.shape[0]
        grid_tokens = torch.cat([anchors.unsqueeze(1), drafts], dim=1)  # [B, K+1]
        column = torch.arange(width + 1, device=device)
        grid_positions = starts.unsqueeze(1) + column.unsqueeze(0)
        used = column.unsqueeze(0) <= lengths.unsqueeze(1)
        counts = lengths + 1
        offsets = torch.zeros(batch + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, dim=0, out=offsets[1:])  # straight into place: no copy after the scan
        total = offsets[-1]
        # a host read, so only outside static-shape mode (graph capture); the budget split
        # never asks for more rows than the tier has
        if not static_shapes_active() and int(total) > tier_rows:
            raise ValueError(f"{int(total)} rows do not fit tier {tier_rows}: the budget policy's split asks for "
                             f"{int(total)} rows (its verify lengths plus one anchor per request), more than the tier its "
                             "choose_tier chose")
        # [B, K+1]: each grid cell's row; unused cells go to a sink row past the end, then get cut off
        target_index = torch.where(used, offsets[:-1].unsqueeze(1) + column.unsqueeze(0), tier_rows)
        tokens = torch.full((tier_rows + 1,), pad_token, dtype=torch.int64, device=device)
        positions = torch.zeros(tier_rows + 1, dtype=torch.int64, device=device)
        row_slots = torch.full((tier_rows + 1,), pad_slot, dtype=torch.int64, device=device)
        # indexed writes take the [B, K+1] grid as it is and broadcast each request's slot over its
        # cells (a scatter wants flat sources: the expanded slots would be copied first)
        tokens[target_index] = grid_tokens
        positions[target_index] = grid_positions
        row_slots[target_index] = slots.unsqueeze(1)
        return PackedRows(tokens[:tier_rows], positions[:tier_rows], row_slots[:tier_rows], offsets)

    pack.__name__ = f"pack_k{width}"
    return pack
