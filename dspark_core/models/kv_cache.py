"""Static slot KV cache: one fixed region per request slot, allocated once.

Layout per layer: ``[2, num_slots, kv_heads, max_len, head_dim]`` (keys, then
values) so that the keys a request attends to (``keys[slot, :, :L]``) are
already in the ``[heads, keys, head_dim]`` order attention wants, and one
indexed write stores a row's keys and values together
(:meth:`KVCache.write_rows`). The cache stores no lengths: the caller
(engine/scheduler) owns each request's committed length. Rows a
speculative step wrote beyond the committed length are simply overwritten by
the next forward, which always starts writing at the committed length.
"""

from __future__ import annotations

import torch
from attrs import define

from dspark_core.errors import ModelError


@define
class KVCache:
    """Keys and values of every layer for ``num_slots`` requests of up to ``max_len`` tokens."""

    kv: torch.Tensor  # [num_layers, 2, num_slots, kv_heads, max_len, head_dim]: keys, then values
    # positions a request may use (None: all of them); fewer than allocated where reads need a
    # longer cache than requests do (a batch-invariant target's whole key blocks)
    limit: int | None = None

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        allocated_len: int | None = None,
    ) -> KVCache:
        """Zero-filled cache; allocation happens here once, never during a step. ``allocated_len``
        (at least ``max_len``) allocates more positions than requests may use, for reads only."""
        allocated = max_len if allocated_len is None else allocated_len
        if allocated < max_len:
            raise ModelError(f"KV cache: allocated_len {allocated} is below max_len {max_len}")
        shape = (num_layers, 2, num_slots, kv_heads, allocated, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), None if allocated == max_len else max_len)

    @property
    def keys(self) -> torch.Tensor:
        """``[num_layers, num_slots, kv_heads, max_len, head_dim]`` (a view; each layer's is contiguous)."""
        return self.kv[:, 0]

    @property
    def values(self) -> torch.Tensor:
        """As :attr:`keys`, for the values."""
        return self.kv[:, 1]

    @property
    def num_slots(self) -> int:
        return int(self.keys.shape[1])

    @property
    def max_len(self) -> int:
        """Positions allocated per slot (what reads may span)."""
        return int(self.values.shape[3])

    @property
    def usable_len(self) -> int:
        """Positions a request may write and attend to."""
        return self.max_len if self.limit is None else self.limit

    def write(self, layer: int, slot_of_row: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ([G, kv_heads, head_dim]) of each row at (slot, position)."""
        # Advanced indices around a slice put the row dimension first: [G, kv_heads, head_dim].
        self.keys[layer][slot_of_row, :, positions] = k.to(self.keys.dtype)
        self.values[layer][slot_of_row, :, positions] = v.to(self.values.dtype)

    def write_rows(self, layer: int, slot_of_row: torch.Tensor, positions: torch.Tensor, kv_rows: torch.Tensor) -> None:
        """Store each row's keys and values ``kv_rows`` ([G, 2, kv_heads, head_dim]) at (slot, position):
        one indexed write where :meth:`write` makes two (on a GPU, one kernel less per layer and step)."""
        # Advanced indices around a slice put the row dimension first: [G, 2, kv_heads, head_dim].
        self.kv[layer][:, slot_of_row, :, positions] = kv_rows.to(self.kv.dtype)

    def read(self, layer: int, slot_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0..length-1`` for each slot: ``[B, kv_heads, length, head_dim]``."""
        both = self.kv[layer][:, slot_ids, :, :length]  # one gather for keys and values: [2, B, ...]
        return both[0], both[1]

    def window(self, layer: int, first_slot: int, num_slots: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of positions ``0..length-1`` of slots ``first_slot .. first_slot+num_slots-1``."""
        last = first_slot + num_slots
        return self.keys[layer][first_slot:last, :, :length], self.values[layer][first_slot:last, :, :length]

    def check_fits(self, max_position: int, num_slots_needed: int | None = None) -> None:
        """Raise a clear error when a position or slot does not fit this cache."""
        if max_position >= self.usable_len:
            raise ModelError(f"KV cache holds {self.usable_len} positions per slot; position {max_position} does not fit")
        if num_slots_needed is not None and num_slots_needed > self.num_slots:
            raise ModelError(f"KV cache has {self.num_slots} slots; slot {num_slots_needed - 1} does not exist")
