"""Context cells: a DSpark draft's proposal blocks laid out by context slot, so that attention reads
the draft's context cache in place.

Each block attends to its own slot's context. Gathering every request's context copies each layer's
whole span per proposal, which on the CPU is slow: on the development CPU, 16 requests over 1 500
context positions took 29-30 ms per proposal with the gather and 14-15 ms reading in place in
float32 (the draft's dtype on CPUs without native bfloat16 products), 12.2-12.6 against 10.5-11.3 ms
in bfloat16. Where the batch's slots are a run of the cache no longer than the
batch (an engine's largest bucket, whose entries hold every slot but the scratch one), the backbone
runs on *cells* instead: cell ``c`` is slot ``first_slot + c`` and computes the block of the entry
on that slot, or a dummy block where none is. Cells never outnumber the entries, so the draft
computes no more rows than on the entries themselves; one gather at the end takes each entry's
result from its cell.

Eager proposals only. A captured proposal gathers: the cells would cost it a dozen small kernels
per replay (built without a host read), as much launch time as the one gather of a single draft
layer's context costs at a GPU's bandwidth.
"""

from __future__ import annotations

import torch
from attrs import frozen

from dspark_core.models.row_layout import slot_run


@frozen
class ContextCells:
    """Where each entry of a proposal batch computes its block: a run of context slots from ``first_slot``."""

    first_slot: int
    count: int  # cells: slots first_slot .. first_slot + count - 1
    # None (all three) where entry i already sits on slot first_slot + i: nothing to reorder
    entry_of_cell: torch.Tensor | None = None  # int64 [C]: the entry whose block each cell computes (0 where none)
    holds_entry: torch.Tensor | None = None  # bool [C]
    cell_of_entry: torch.Tensor | None = None  # int64 [n]: the cell each entry reads its result back from

    @classmethod
    def eager(cls, slots: list[int], padding_slot: int | None, device: torch.device) -> ContextCells | None:
        """Cells for entries on ``slots`` (read back to the host), or None when the slots of the entries
        not on ``padding_slot`` repeat or span more slots than there are entries (the keys are then
        gathered). Entries on ``padding_slot`` are padding: they read back cell 0."""
        live = [entry for entry, slot in enumerate(slots) if slot != padding_slot]
        run = slot_run(slots, live)
        if run is None or run[1] > len(slots):
            return None
        first, width = run
        if len(live) == len(slots) and all(slot == first + entry for entry, slot in enumerate(slots)):
            return cls(first, width)  # (one request always: its slot's context as a view, no gathers)
        entry_of_cell, holds, cell_of_entry = [0] * width, [False] * width, [0] * len(slots)
        for entry in live:
            cell = slots[entry] - first
            entry_of_cell[cell], holds[cell], cell_of_entry[entry] = entry, True, cell

        def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(first, width, as_tensor(entry_of_cell, torch.long), as_tensor(holds, torch.bool),
                   as_tensor(cell_of_entry, torch.long))
