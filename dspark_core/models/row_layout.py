"""How a forward's packed rows map to per-request attention rows, computed once per forward."""

from __future__ import annotations

import torch
from attrs import frozen

from dspark_core.errors import ModelError


# A window of slots is read in place when it spans at most this many slots per live request:
# attending a few idle slots' keys costs less than copying every live slot's prefix each layer
# (SmolLM2 attention, 16 requests x 400 keys, one layer, 1 thread: 0.8 ms in place, 6.9 ms gathered).
_MAX_WINDOW_SLOTS_PER_REQUEST = 2


def static_window_pays(num_slots: int, requests: int) -> bool:
    """Whether a static-shape forward of ``requests`` requests (the padding one included) over a cache
    of ``num_slots`` slots reads the whole cache in place (:meth:`RowLayout.static_window`) rather
    than gathering each request's keys: by the eager rule, when that is at most
    ``_MAX_WINDOW_SLOTS_PER_REQUEST`` slots per request. An engine's largest bucket then reads in place
    (its cache has one slot per bucket entry and the scratch slot); one request of sixteen gathers."""
    return num_slots <= _MAX_WINDOW_SLOTS_PER_REQUEST * requests


def window_cells(num_slots: int, padding_slot: int | None) -> int:
    """Slots an in-place read over a cache of ``num_slots`` slots attends from slot 0: every slot but the
    padding slot when it is the last one (the engine's scratch slot), whose rows nobody reads."""
    return num_slots - 1 if padding_slot == num_slots - 1 else num_slots


def rows_of_cells(cell_of_row: torch.Tensor, placed: torch.Tensor, cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``cells`` cells' row (0 where it holds none) and whether it holds one, for rows in cells
    ``cell_of_row`` where ``placed`` (the others go nowhere), without a host read: unplaced rows write
    into one sink cell past the end, which is then cut off. Where rows share a cell, any of them wins."""
    target = torch.where(placed, cell_of_row, cells)
    row_of_cell = torch.zeros(cells + 1, dtype=torch.long, device=cell_of_row.device)
    row_of_cell[target] = torch.arange(cell_of_row.shape[0], device=cell_of_row.device)
    holds = torch.zeros(cells + 1, dtype=torch.bool, device=cell_of_row.device)
    holds[target] = True
    return row_of_cell[:cells], holds[:cells]


def slot_run(slots: list[int], live: list[int]) -> tuple[int, int] | None:
    """``(first slot, width)`` of the run of cache slots that the entries ``live`` of a batch on ``slots``
    (host lists) span, or None when there are none or their slots repeat: what an in-place read of
    the cache would cover. The callers decide how wide a run still pays."""
    live_slots = [slots[i] for i in live]
    if not live or len(set(live_slots)) != len(live_slots):
        return None
    return min(live_slots), max(live_slots) - min(live_slots) + 1


def _slot_window(counts: list[int], slots: list[int], padding_slot: int | None) -> tuple[int, int, list[int]] | None:
    """``(first slot, width, live requests)`` of the slot window of a batch (host lists), or None
    when the live requests' slots repeat or are spread too thinly for reading in place to pay."""
    live = [i for i, (count, slot) in enumerate(zip(counts, slots)) if count > 0 and slot != padding_slot]
    run = slot_run(slots, live)
    if run is None or run[1] > _MAX_WINDOW_SLOTS_PER_REQUEST * len(live):
        return None
    return run[0], run[1], live


@frozen
class RowLayout:
    """How packed rows map to a padded ``[B, R_max]`` view, computed once per forward.

    Linear layers run on the packed rows; only attention uses the padded view,
    gathered through ``pad_index`` (padding entries point at row 0) and
    scattered back through ``unpad_index`` (an integer gather, so going back
    needs no host read and has the fixed shape ``[G]``).

    Padded row ``b`` is request ``b``, whose keys are gathered from its cache
    slot; or, in a *slot window* (``first_slot`` set), cache slot
    ``first_slot + b``, so attention reads a contiguous run of slots in place
    and idle slots in the run get dummy queries. Rows of padding requests then
    come back as a copy of a live row (their outputs are never read).
    """

    pad_index: torch.Tensor  # int64 [B, R_max]
    valid: torch.Tensor  # bool [B, R_max]
    slot_of_row: torch.Tensor  # int64 [G]
    query_positions: torch.Tensor  # int64 [B, R_max]; 0 on padding
    kv_len: int  # keys needed: max position + 1
    unpad_index: torch.Tensor  # int64 [G]: each packed row's cell in the flattened [B * R_max] view
    first_slot: int | None = None  # slot window start; None: padded rows are requests

    @classmethod
    def build(cls, positions: torch.Tensor, slot_ids: torch.Tensor, row_offsets: torch.Tensor, *,
              max_rows: int | None = None, kv_len: int | None = None, slot_window: bool = False,
              padding_slot: int | None = None, max_request_rows: int | None = None,
              padding_last: bool = False) -> RowLayout:
        """Layout of a batch. With ``max_rows`` and ``kv_len`` given (static-shape mode) nothing is
        read back to the host and every shape is fixed by the arguments; a request with more rows
        than ``max_rows`` (only the padding one may have them) attends its first ``max_rows`` and
        its later rows read back the last of those; with ``padding_last`` the last request (the
        padding one) gets no attention rows at all and its rows read back another request's. The
        eager layout ignores ``padding_last``. Otherwise one host read sizes it (and checks
        ``max_request_rows``, the bound a static forward of the same batch would be given), and with
        ``slot_window`` the keys are read in place when the live requests' slots (those not on
        ``padding_slot``) are close enough together."""
        counts = row_offsets[1:] - row_offsets[:-1]
        requests = counts.shape[0]
        window = None
        if max_rows is None or kv_len is None:
            host = torch.cat([counts, slot_ids, positions.max()[None]]).tolist()  # the one host read
            if max_request_rows is not None:
                _check_request_rows(host[:requests], host[requests : 2 * requests], padding_slot, max_request_rows)
            max_rows = max(host[:requests]) if max_rows is None else max_rows
            kv_len = host[-1] + 1 if kv_len is None else kv_len
            if slot_window:
                window = _slot_window(host[:requests], host[requests : 2 * requests], padding_slot)
                first_cell = host[requests + window[2][0]] - window[0] if window is not None else 0
        else:
            # a static layout may leave the padding request out: its rows then count as the one before's
            # (their step is past that request's rows or clamped, so they read back one of its cells)
            requests -= int(padding_last)
        device = positions.device
        steps = torch.arange(max_rows, device=device)
        valid = steps[None, :] < counts[:requests, None]
        pad_index = torch.where(valid, row_offsets[:requests, None] + steps[None, :],
                                torch.zeros_like(valid, dtype=torch.long))
        query_positions = torch.where(valid, positions[pad_index], torch.zeros_like(pad_index))
        slot_of_row, request_of_row, step_of_row = _row_coordinates(positions, slot_ids, row_offsets, counts, max_rows,
                                                                    cells=requests)
        if window is None:
            return cls(pad_index, valid, slot_of_row, query_positions, kv_len, request_of_row * max_rows + step_of_row)
        first_slot, width, live = window
        live_index = torch.tensor(live, device=device)
        cell_of_live = slot_ids[live_index] - first_slot
        # padding requests read back the first cell of the first live request
        cell_of_request = torch.full((requests,), first_cell, dtype=torch.long, device=device)
        cell_of_request[live_index] = cell_of_live
        is_live = torch.zeros(requests, dtype=torch.bool, device=device)
        is_live[live_index] = True

        def to_window(per_request: torch.Tensor) -> torch.Tensor:
            out = per_request.new_zeros((width, max_rows))
            out[cell_of_live] = per_request[live_index]
            return out

        unpad_index = cell_of_request[request_of_row] * max_rows + torch.where(is_live[request_of_row], step_of_row, 0)
        return cls(to_window(pad_index), to_window(valid), slot_of_row, to_window(query_positions), kv_len,
                   unpad_index, first_slot)

    @classmethod
    def static_window(cls, positions: torch.Tensor, slot_ids: torch.Tensor, row_offsets: torch.Tensor, *,
                      num_slots: int, max_rows: int, kv_len: int, padding_slot: int | None = None) -> RowLayout:
        """Static-shape layout over the cache's slots (a slot window from slot 0, of every slot but a
        last one that is ``padding_slot``: :func:`window_cells`): each request's rows sit in its slot's
        cell, so attention reads the cache in place instead of gathering each request's keys and values
        (a copy of every layer's cache span per step). No host read. Cells of idle slots get dummy
        queries; a request with more rows than ``max_rows`` (only the padding one) attends its first
        ``max_rows``, its later rows reading back one of those, and rows on a slot past the window (the
        padding slot's) read back cell 0. Slots must be distinct between requests that have rows (the
        scratch slot's empty entries have none)."""
        slots = window_cells(num_slots, padding_slot)
        slot_of_row, _, step_of_row = _row_coordinates(positions, slot_ids, row_offsets,
                                                       row_offsets[1:] - row_offsets[:-1], max_rows)
        in_window = slot_of_row < slots
        # (several rows share a cell only past the padding request's bound: any of them will do)
        cell = slot_of_row * max_rows + step_of_row
        pad_index, valid = rows_of_cells(cell, in_window, slots * max_rows)
        pad_index, valid = pad_index.view(slots, max_rows), valid.view(slots, max_rows)
        query_positions = torch.where(valid, positions[pad_index], torch.zeros_like(pad_index))
        return cls(pad_index, valid, slot_of_row, query_positions, kv_len, torch.where(in_window, cell, 0), 0)

    def read(self, cache, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, kv_heads, kv_len, head_dim]`` of ``layer`` for the padded rows: a
        view of the slot window, or the requests' slots gathered."""
        if self.first_slot is None:  # (a static layout may have left the last request, the padding one, out)
            return cache.read(layer, slot_ids[: self.pad_index.shape[0]], self.kv_len)
        return cache.window(layer, self.first_slot, int(self.pad_index.shape[0]), self.kv_len)

    def causal_mask(self, kv_len: int | None = None) -> torch.Tensor:
        """Boolean ``[B, 1, R_max, L]``: a query sees keys at positions <= its own."""
        length = self.kv_len if kv_len is None else kv_len
        key_pos = torch.arange(length, device=self.pad_index.device)
        return (key_pos[None, None, None, :] <= self.query_positions[:, None, :, None])

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed ``[G, ...]`` -> padded ``[B, R_max, ...]``."""
        return rows[self.pad_index]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, R_max, ...]`` -> packed ``[G, ...]`` (row order is preserved)."""
        return padded.flatten(0, 1)[self.unpad_index]

    def head_folding(self, heads: int, kv_heads: int) -> HeadFolding:
        """The gathers between packed ``[G, heads, d]`` queries and the folded attention layout
        ``[B, kv_heads, (heads / kv_heads) * R_max, d]`` (see :func:`folded_attention`), for
        :func:`attend`; build it once per forward, not per layer."""
        requests, rows = self.pad_index.shape
        head = torch.arange(heads, device=self.pad_index.device)
        folded = (requests, kv_heads, heads // kv_heads * rows)
        gather_rows = self.pad_index[:, None, :].expand(requests, heads, rows).reshape(folded)
        gather_heads = head[None, :, None].expand(requests, heads, rows).reshape(folded)
        cell, step = self.unpad_index // rows, self.unpad_index % rows
        scatter = ((cell * heads)[:, None] + head[None, :]) * rows + step[:, None]
        return HeadFolding(gather_rows, gather_heads, scatter)


@frozen
class HeadFolding:
    """Indices that take packed queries straight into the folded attention layout and its output
    straight back: one gather each way per layer, where padding then folding (and unfolding then
    unpadding) copy the rows twice more whenever a request has more than one row. The queries are
    indexed by (row, head), so a query view of the fused q/k/v projection is read in place."""

    gather_rows: torch.Tensor  # int64 [B, KV, groups * R_max]: the packed row of each folded query row
    gather_heads: torch.Tensor  # int64 [B, KV, groups * R_max]: its query head
    scatter: torch.Tensor  # int64 [G, H]: rows of the folded output viewed as [B * KV * groups * R_max, d]


def _row_coordinates(positions: torch.Tensor, slot_ids: torch.Tensor, row_offsets: torch.Tensor, counts: torch.Tensor,
                     max_rows: int, cells: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each packed row's slot, request and step within its request ``[G]``; steps past ``max_rows - 1``
    (a static layout's padding request only: eager layouts fit every request) are clamped to it.
    ``cells``: requests from this one on (a left-out padding request) count as request ``cells - 1``."""
    rows, device = positions.shape[0], positions.device
    slot_of_row = torch.repeat_interleave(slot_ids, counts, output_size=rows)
    request = torch.arange(counts.shape[0], device=device)
    if cells is not None and cells < counts.shape[0]:
        request.clamp_(max=cells - 1)
    request_of_row = torch.repeat_interleave(request, counts, output_size=rows)
    step_of_row = (torch.arange(rows, device=device) - row_offsets[request_of_row]).clamp_(max=max_rows - 1)
    return slot_of_row, request_of_row, step_of_row


def _check_request_rows(counts: list[int], slots: list[int], padding_slot: int | None, bound: int) -> None:
    """Raise when a request not on ``padding_slot`` has more rows than a static forward would attend."""
    for request, (count, slot) in enumerate(zip(counts, slots)):
        if count > bound and slot != padding_slot:
            raise ModelError(f"request {request} (slot {slot}) has {count} rows, more than the batch's "
                             f"max_request_rows {bound}")
