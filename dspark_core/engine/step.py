"""One decode step, top to bottom: proposal -> budget selection -> verification -> commit.

The engine builds a :class:`DecodeStep` for the running requests and calls the
four step hooks in order; the default implementations below are registered by
the ``stages`` plugin (``dspark_plugins.stages``) like any other plugin, so a
third party can replace a stage without forking the engine.
"""

from __future__ import annotations

import numpy as np
import torch
from attrs import define, field, frozen

from dspark_core.engine.runner import ModelRunner
from dspark_core.engine.slots import SlotStorage
from dspark_core.policy import TierChoice, TierContext
from dspark_kernels.accept_commit import Acceptance, commit_tokens, gather_target_tokens
from dspark_kernels.pack import PackedRows


@frozen
class Proposal:
    """The drafted block of every running request."""

    tokens: torch.Tensor  # [n, K] int64
    confidences: torch.Tensor  # [n, K] float32


@frozen
class Budget:
    """The chosen tier and each request's verify length."""

    choice: TierChoice
    lengths: torch.Tensor  # [n] int64


@frozen
class Verification:
    """What the target decided for this step."""

    packed: PackedRows
    acceptance: Acceptance
    real_rows: int


@define
class DecodeStep:
    """Everything one step needs; built by the engine, read by the stage hooks."""

    runner: ModelRunner
    storage: SlotStorage
    policy: object
    tier_context: TierContext
    slots: torch.Tensor  # [n] KV slot of each running request
    anchors: torch.Tensor  # [n] last committed token
    positions: torch.Tensor  # [n] position of the anchor
    caps: torch.Tensor  # [n] most drafted tokens each request may verify
    results: dict = field(factory=dict)  # observers may stash per-step facts here


def propose(step: DecodeStep) -> Proposal:
    """Draft K tokens per request (zeros when the policy runs no draft)."""
    n, width = step.slots.shape[0], step.runner.draft_width
    if not step.policy.uses_draft:  # type: ignore[attr-defined]
        zeros = torch.zeros(n, width, dtype=torch.int64, device=step.slots.device)
        return Proposal(zeros, torch.zeros(n, width, dtype=torch.float32, device=step.slots.device))
    tokens, confidences = step.runner.propose(step.anchors, step.positions, step.slots)
    step.storage.record_proposal(step.slots, tokens, confidences)
    return Proposal(tokens, confidences)


def select_budget(step: DecodeStep, proposal: Proposal) -> Budget:
    """Tier from (possibly older) confidences on the host, split with the current ones."""
    policy = step.policy
    lag = policy.tier_lag  # type: ignore[attr-defined]
    stale = step.storage.stale_confidences(step.slots, lag) if lag else proposal.confidences
    caps_host = step.caps.cpu().numpy()
    choice = policy.choose_tier(step.tier_context, stale.cpu().numpy().astype(np.float64), caps_host)  # type: ignore[attr-defined]
    lengths = policy.split(step.runner.kernels, proposal.confidences, step.caps, choice,  # type: ignore[attr-defined]
                           step.tier_context.request_bucket)
    return Budget(choice, lengths)


def verify(step: DecodeStep, proposal: Proposal, budget: Budget) -> Verification:
    """Pack the tier's rows, run the target once, accept the longest matching prefixes."""
    runner = step.runner
    packed = runner.kernels.pack(step.anchors, proposal.tokens, budget.lengths, step.positions, step.slots,
                                 budget.choice.rows, runner.scratch_slot)
    out = runner.forward(runner.verify_batch(packed, step.slots))
    greedy = out.logits.argmax(dim=-1)
    grid = gather_target_tokens(greedy, packed.row_offsets, runner.draft_width)
    acceptance = runner.kernels.accept(proposal.tokens, budget.lengths, grid)
    real_rows = int(packed.row_offsets[-1])
    if out.hidden is not None:
        # the draft's context learns the target's view of every real row; rejected rows
        # sit past the new anchor and are overwritten before they are ever attended
        runner.extend_draft_context(out.hidden[:real_rows], packed.positions[:real_rows],
                                    packed.row_slots[:real_rows])
    return Verification(packed, acceptance, real_rows)


def commit(step: DecodeStep, verification: Verification) -> None:
    """Append committed tokens (accepted drafts + bonus) to slot storage."""
    storage = step.storage
    commit_tokens(storage.output_tokens, storage.output_lengths, step.slots, verification.acceptance)
