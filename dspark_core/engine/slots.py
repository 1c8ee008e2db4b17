"""Per-slot device storage, sized to the launch's draft width K (never padded to 7).

One slot per concurrently running request, plus one scratch slot that absorbs
the writes of padding rows. Storage holds the step's drafted tokens and
confidences, confidence history for lagged tier decisions, committed output
tokens and lengths.
"""

from __future__ import annotations

import torch


class SlotStorage:
    """Fixed-size tensors indexed by slot id; allocated once at warmup."""

    def __init__(self, num_slots: int, draft_width: int, max_output: int, max_lag: int = 2,
                 device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.draft_width = draft_width
        self.scratch_slot = num_slots  # padding rows write here
        total = num_slots + 1
        self.draft_tokens = torch.zeros(total, draft_width, dtype=torch.int64, device=device)
        self.confidences = torch.zeros(total, draft_width, dtype=torch.float32, device=device)
        # confidence_history[lag] = confidences proposed `lag` steps ago ([0] = this step's)
        self.confidence_history = torch.ones(max_lag + 1, total, draft_width, dtype=torch.float32, device=device)
        self.output_tokens = torch.zeros(total, max_output, dtype=torch.int64, device=device)
        self.output_lengths = torch.zeros(total, dtype=torch.int64, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    def acquire(self) -> int:
        """Take a free slot (raises when none is left: the scheduler admits only up to capacity)."""
        if not self._free:
            raise RuntimeError("no free slot")
        slot = self._free.pop()
        self.output_lengths[slot] = 0
        self.confidence_history[:, slot] = 1.0  # unknown history: assume every draft survives
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def record_proposal(self, slots: torch.Tensor, tokens: torch.Tensor, confidences: torch.Tensor) -> None:
        """Store this step's block and push its confidences into the feedback history."""
        self.draft_tokens[slots] = tokens
        self.confidences[slots] = confidences.float()
        self.confidence_history[1:, slots] = self.confidence_history[:-1, slots].clone()
        self.confidence_history[0, slots] = confidences.float()

    def stale_confidences(self, slots: torch.Tensor, lag: int) -> torch.Tensor:
        """Confidences proposed ``lag`` steps ago for ``slots`` (lag 0 = the current block)."""
        return self.confidence_history[lag, slots]
