"""Per-slot device storage, sized to the launch's draft width K (never padded to 7).

One slot per concurrently running request, plus one scratch slot that absorbs
the writes of padding rows. A decode step reads its anchors and positions from
here and its commit writes them back, so step t+1 can be launched before the
host has seen step t's results (the task pipeline).
"""

from __future__ import annotations

import torch

from dspark_kernels.accept_commit import Acceptance, commit_tokens
from dspark_kernels.copy_lookup import copy_lookup


class SlotStorage:
    """Fixed-size tensors indexed by slot id; allocated once at warmup."""

    def __init__(self, num_slots: int, draft_width: int, max_output: int, device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.draft_width = draft_width
        self.scratch_slot = num_slots  # padding rows write here
        total = num_slots + 1
        self.draft_tokens = torch.zeros(total, draft_width, dtype=torch.int64, device=device)
        self.confidences = torch.zeros(total, draft_width, dtype=torch.float32, device=device)
        self.last_token = torch.zeros(total, dtype=torch.int64, device=device)  # the next anchor
        self.seq_len = torch.zeros(total, dtype=torch.int64, device=device)  # committed tokens incl. prompt
        # every committed token by position, prompt included (copy proposals look things up in it; a
        # request's output is history[slot, prompt length : seq_len], and the host learns each step's
        # tokens from the verify key's host result, so no separate output buffer is kept);
        # K + 1 spare columns take a commit's cells past the committed ones without folding
        self.history = torch.zeros(total, max_output + draft_width + 1, dtype=torch.int64, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    def acquire(self) -> int:
        """Take a free slot (the scheduler admits only up to capacity)."""
        if not self._free:
            raise RuntimeError("no free slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def write_prompts(self, tokens: torch.Tensor, positions: torch.Tensor, row_slots: torch.Tensor) -> None:
        """Record prompt tokens in the history (one entry per prefilled row)."""
        self.history[row_slots, positions] = tokens

    def start(self, slots: torch.Tensor, prompt_lengths: torch.Tensor, first_tokens: torch.Tensor) -> None:
        """Initialise slots after prefill: the first generated token becomes the anchor."""
        self.history[slots, prompt_lengths] = first_tokens
        self.seq_len[slots] = prompt_lengths + 1
        self.last_token[slots] = first_tokens

    def anchors(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Anchor token and its position for each slot."""
        return self.last_token[slots], self.seq_len[slots] - 1

    def copies(self, slots: torch.Tensor, orders: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy proposals of these slots from their history: tokens, lengths and the index of the
        order that matched (see :mod:`dspark_kernels.copy_lookup`)."""
        return copy_lookup(self.history, slots, self.seq_len, orders, self.draft_width)

    def record_proposal(self, slots: torch.Tensor, tokens: torch.Tensor, confidences: torch.Tensor) -> None:
        self.draft_tokens[slots] = tokens
        self.confidences[slots] = confidences.float()

    def commit(self, slots: torch.Tensor, acceptance: Acceptance) -> None:
        """Append each request's committed tokens (accepted drafts + bonus) and move its anchor on.

        Read-free and fixed-shape. Slots may repeat only on the scratch slot (bucket padding),
        whose values nobody reads.
        """
        self.last_token[slots] = acceptance.committed.gather(1, acceptance.accepted.unsqueeze(1)).squeeze(1)
        commit_tokens(self.history, self.seq_len, slots, acceptance)  # advances seq_len by accepted + 1
