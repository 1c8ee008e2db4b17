"""One-row cells: a static-shape forward in which every request has at most one row.

Target-only and draft-off steps verify one row per request (the anchor). A static-shape (captured)
forward cannot read which rows belong to which request, so the general layout
(:class:`~dspark_core.models.row_layout.RowLayout`) gathers each layer's queries into a per-request
attention layout and scatters the outputs back: two device kernels per layer, 60 per step for
SmolLM2.

With one row per request the forward can instead reorder its rows once, at the embedding: row ``c``
of the forward is *cell* ``c`` (a request, or a cache slot where the keys are read in place), so a
layer's queries ``[C, heads, d]`` are already the folded attention layout ``[C, kv_heads, groups, d]``
(a view where ``C`` is 1, one copy otherwise) and the attention output is the next product's input
as it is. One gather at the end takes the packed rows' results back from their cells.

Cells that hold no row (an idle slot, an empty bucket entry) still compute a dummy row at position 0;
its keys and values are written to the padding slot, whose contents nothing reads, so a slot that
belongs to a request outside this batch (one still prefilling) is never touched.
"""

from __future__ import annotations

import torch
from attrs import frozen

from dspark_core.models.attention import attention_of_folded
from dspark_core.models.row_layout import RowLayout, rows_of_cells


@frozen
class OneRowCells:
    """Where each row of a one-row-per-request batch is computed, built without a host read."""

    row_of_cell: torch.Tensor  # int64 [C]: the packed row each cell computes (0 where it holds none)
    cell_of_row: torch.Tensor  # int64 [G]: the cell whose result each packed row reads back
    positions: torch.Tensor  # int64 [C]: each cell's row position (0 where it holds none)
    layout: RowLayout  # attention over the cells: one row each; ``slot_of_row`` is each cell's write slot

    @classmethod
    def build(cls, positions: torch.Tensor, slot_ids: torch.Tensor, row_offsets: torch.Tensor, *, kv_len: int,
              padding_slot: int, window_slots: int | None, padding_last: bool = False) -> OneRowCells:
        """Cells of a batch whose requests have at most one row each, except a padding request on
        ``padding_slot`` whose rows' results are never read.

        ``window_slots``: the cells are cache slots ``0 .. window_slots - 1`` and attention reads the
        cache in place (a request's row sits in its slot's cell; rows on other slots, the padding
        ones, read back cell 0). None: the cells are the batch's requests, whose keys are gathered,
        and a request with several rows (the padding one) computes its first; with ``padding_last``
        the last request (the padding one) gets no cell and its rows read back the cell before."""
        rows, device = positions.shape[0], positions.device
        if window_slots is None:
            counts = row_offsets[1:] - row_offsets[:-1]
            cells = counts.shape[0] - int(padding_last)
            holds_row = counts[:cells] > 0
            row_of_cell = torch.where(holds_row, row_offsets[:cells], 0)
            slot_of_cell = slot_ids[:cells]
            cell_of_request = torch.arange(counts.shape[0], device=device)
            if padding_last:
                cell_of_request.clamp_(max=cells - 1)
            cell_of_row = torch.repeat_interleave(cell_of_request, counts, output_size=rows)
        else:
            cells = window_slots
            slot_of_row = torch.repeat_interleave(slot_ids, row_offsets[1:] - row_offsets[:-1], output_size=rows)
            in_window = slot_of_row < cells  # rows outside the window (the padding slot's) go nowhere
            row_of_cell, holds_row = rows_of_cells(slot_of_row, in_window, cells)
            slot_of_cell = torch.arange(cells, device=device)
            cell_of_row = torch.where(in_window, slot_of_row, 0)
        cell_positions = torch.where(holds_row, positions[row_of_cell], 0)
        write_slot = torch.where(holds_row, slot_of_cell, padding_slot)
        identity = torch.arange(cells, device=device)
        layout = RowLayout(identity[:, None], holds_row[:, None], write_slot, cell_positions[:, None], kv_len,
                           identity, None if window_slots is None else 0)
        return cls(row_of_cell, cell_of_row, cell_positions, layout)


def attend_cells(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 invariant: bool = False) -> torch.Tensor:
    """Attention of one query row per cell, ``q`` ``[C, heads, d]`` over keys ``[C, kv_heads, L, d]``
    (``mask`` and ``invariant`` as :func:`~dspark_core.models.attention.attend` takes them): the query
    heads of a key head are already its folded rows. Returns ``[C, heads * d]``."""
    cells, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    folded = q.reshape(cells, kv_heads, heads // kv_heads, head_dim)
    return attention_of_folded(folded, keys, values, mask, invariant).reshape(cells, heads * head_dim)
