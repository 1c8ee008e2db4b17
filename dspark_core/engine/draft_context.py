"""Target rows waiting to enter the draft's context cache.

Every target forward (prefill, verify, draft-off steps alike) yields the hidden
states the draft's context needs for the rows it ran. Writing them costs the
draft's ``fc`` and K/V projections per row, which a step the policy runs
without the draft should not pay. So the runner queues the rows here and
writes them right before the next proposal, in one batched write:

* the newest row wins where a slot and position repeat (a drafted step's
  rejected rows are rewritten by the next step; a released slot is reused by
  a new prompt). Rows a newer one overwrites go to the scratch slot, which no
  proposal reads, instead of being cut out, so the write reads nothing back;
* rows of requests that ended before the write are dropped: nothing will
  draft from them. Only a queue of several steps (after draft-off steps) is
  filtered; a drafted step's queue holds one step and is written as it is,
  which keeps the drafting path free of host reads;
* the queue is bounded: past ``max_rows`` it first drops the rows of ended
  requests and writes everything only if it is still too long.
"""

from __future__ import annotations

import torch
from attrs import define

from dspark_core.models.base import DraftModel


@define
class QueuedRows:
    """One forward's rows: hidden states, positions, slots, and the queue number of each row."""

    hidden: torch.Tensor  # [G, n_aux * d]
    positions: torch.Tensor  # [G]
    row_slots: torch.Tensor  # [G]
    sequence: torch.Tensor | int  # queue number of the forward (per row once parts are merged)

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])


class DraftContextQueue:
    """Rows for the draft's context, written in order (newest wins) when the draft next proposes."""

    def __init__(self, draft: DraftModel, *, num_slots: int, max_len: int, scratch_slot: int, max_rows: int) -> None:
        self.draft = draft
        self.num_slots = num_slots
        self.max_len = max_len
        self.scratch_slot = scratch_slot
        self.max_rows = max_rows
        self._parts: list[QueuedRows] = []
        self._rows = 0  # kept with the parts: ``put`` checks it on every step
        self._sequence = 0  # forwards queued so far
        # slot -> queue number of the last forward queued before the slot's request ended: that
        # slot's rows up to it are dead. Only the engine's thread writes it (``release``); the
        # parts are touched only by the thread that runs the device work. A slot is released
        # once no launched step uses it, and its next request is queued after that, so a
        # release never marks a live row dead
        self._released: dict[int, int] = {}

    @property
    def rows(self) -> int:
        """Rows waiting to be written."""
        return self._rows

    def put(self, hidden: torch.Tensor, positions: torch.Tensor, row_slots: torch.Tensor) -> None:
        """Queue one forward's rows (called on the device thread, in execution order)."""
        self._sequence += 1
        self._parts.append(QueuedRows(hidden, positions, row_slots, self._sequence))
        self._rows += int(hidden.shape[0])
        if self._rows >= self.max_rows:
            self._compact()
            if self._rows >= self.max_rows:
                self.flush()

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended: the rows queued for it so far will never be drafted from."""
        self._released[slot] = self._sequence

    def flush(self) -> None:
        """Write every queued row into the draft's context cache (nothing when the queue is empty)."""
        parts = self._parts
        self._parts, self._rows = [], 0
        if not parts:
            return
        # one forward never repeats a (slot, position) outside the scratch slot; a compacted part
        # (per-row queue numbers) holds several
        if len(parts) == 1 and isinstance(parts[0].sequence, int):
            self.draft.extend_context(parts[0].hidden, parts[0].positions, parts[0].row_slots)
            return
        rows = self._live(parts)
        key = rows.row_slots * self.max_len + rows.positions
        order = torch.arange(key.shape[0], device=key.device)
        newest = torch.full(((self.num_slots + 1) * self.max_len,), -1, dtype=torch.int64, device=key.device)
        newest.scatter_reduce_(0, key, order, reduce="amax")
        row_slots = torch.where(newest[key] == order, rows.row_slots, self.scratch_slot)
        self.draft.extend_context(rows.hidden, rows.positions, row_slots)

    def _compact(self) -> None:
        """Drop the rows of ended requests, keeping the rest in order as one part."""
        if len(self._parts) < 2:
            return
        merged = self._live(self._parts)
        self._parts, self._rows = [merged], merged.rows

    def _live(self, parts: list[QueuedRows]) -> QueuedRows:
        """The parts' rows in queue order, without those of requests that ended after them."""
        device = parts[0].positions.device
        sequence = torch.cat([p.sequence if isinstance(p.sequence, torch.Tensor)
                              else torch.full((p.rows,), p.sequence, dtype=torch.int64) for p in parts]).to(device)
        hidden = torch.cat([p.hidden for p in parts])
        positions = torch.cat([p.positions for p in parts])
        row_slots = torch.cat([p.row_slots for p in parts])
        released = dict(self._released)
        if released:
            last_dead = torch.zeros(self.num_slots + 1, dtype=torch.int64)
            last_dead[list(released)] = torch.tensor(list(released.values()), dtype=torch.int64)
            live = sequence > last_dead.to(device)[row_slots]
            hidden, positions, row_slots, sequence = hidden[live], positions[live], row_slots[live], sequence[live]
        return QueuedRows(hidden, positions, row_slots, sequence)
