"""One decode step, top to bottom: proposal -> budget selection -> verification -> commit.

The engine builds a :class:`DecodeStep` for the running requests and runs the
four stages below in order through :class:`StepStages`. The core holds the
implementation; each stage hook (``dspark_propose`` ...) is the seam where a
third party plugs in: a plugin that implements one replaces that stage (or
observes commits), and a stage nobody replaced is called directly, so the
default step crosses no plugin machinery.

A step reads its anchors from slot storage and its commit writes them back, so
with the task pipeline the host can launch step t+1 before step t's results
reach it. Only :func:`collect` copies results to the host, once per step; the
other host reads a step may make are the policy's own (the tier decision on
this step's confidences when ``tier_lag`` is 0, the early copy of the
confidences for ``tier_lag`` 1 under schedule overlap; see docs/cuda.md).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import torch

from attrs import define, frozen

from dspark_core.engine.runner import ModelRunner
from dspark_core.engine.slots import SlotStorage
from dspark_core.plugins import Hooks
from dspark_core.policy import BudgetPolicy, TierChoice, TierContext, draft_off_choice
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

    @property
    def real_rows(self) -> int:
        """Rows that carry a request's token (the rest pad the tier); reads the device."""
        return int(self.packed.row_offsets[-1])


@define
class DecodeStep:
    """Everything one step needs; built by the engine, read by the stage hooks."""

    runner: ModelRunner
    storage: SlotStorage
    policy: BudgetPolicy
    tier_context: TierContext
    slots: torch.Tensor  # [n] KV slot of each running request
    caps: torch.Tensor  # [n] most drafted tokens each request may verify
    # the same caps as the host built them, so the tier decision reads nothing back from the device
    # (None: copy ``caps`` back, one device-to-host read)
    host_caps: np.ndarray | None = None
    # Confidences the host had when it scheduled the step, exactly ``tier_lag`` steps old;
    # None: decide the tier on this step's own proposal (lag 0).
    tier_confidences: np.ndarray | None = None
    # False: a draft-off step (the policy's plan): no proposal, one target row per request
    draft: bool = True
    index: int = 0  # the engine's decode-step counter when the step was built
    # set to the host copy of the confidences right after the proposal, when the host
    # building the next step waits for them (tier_lag 1 with schedule overlap)
    proposal_ready: Future[np.ndarray] | None = None


@frozen
class StepResult:
    """Host copy of a finished step: what each request committed and what it drafted."""

    accepted: list[int]
    committed: list[list[int]]
    lengths: list[int]
    confidences: np.ndarray  # [n, K]
    choice: TierChoice

    @property
    def drafted(self) -> bool:
        """False for a draft-off step (its confidences are zeros, not a proposal)."""
        return not self.choice.draft_off


def propose(step: DecodeStep) -> Proposal:
    """Draft K tokens per request (zeros when the policy runs no draft, or not this step)."""
    n, width = step.slots.shape[0], step.runner.draft_width
    if not step.draft or not step.policy.uses_draft:
        zeros = torch.zeros(n, width, dtype=torch.int64, device=step.slots.device)
        return Proposal(zeros, torch.zeros(n, width, dtype=torch.float32, device=step.slots.device))
    anchors, positions = step.storage.anchors(step.slots)
    tokens, confidences = step.runner.propose(anchors, positions, step.slots, step.tier_context.request_bucket)
    step.storage.record_proposal(step.slots, tokens, confidences)
    if step.proposal_ready is not None:
        step.proposal_ready.set_result(confidences.float().cpu().numpy().astype(np.float64))
    return Proposal(tokens, confidences.float())


def select_budget(step: DecodeStep, proposal: Proposal) -> Budget:
    """Tier from the host's (possibly older) confidences; split with the current ones."""
    policy = step.policy
    if not step.draft:  # the plan turned the draft off: anchors only, nothing to split
        return Budget(draft_off_choice(step.tier_context), torch.zeros_like(step.caps))
    tier_confidences = step.tier_confidences
    if tier_confidences is None:
        tier_confidences = proposal.confidences.cpu().numpy().astype(np.float64)
    caps = step.host_caps if step.host_caps is not None else step.caps.cpu().numpy()
    choice = policy.choose_tier(step.tier_context, tier_confidences, caps)
    lengths = policy.split(step.runner.kernels, proposal.confidences, step.caps, choice, step.tier_context.request_bucket)
    return Budget(choice, lengths)


def verify(step: DecodeStep, proposal: Proposal, budget: Budget) -> Verification:
    """Pack the tier's rows, run the target once, accept the longest matching prefixes."""
    runner = step.runner
    anchors, positions = step.storage.anchors(step.slots)
    with runner.step_mode():
        packed = runner.kernels.pack(anchors, proposal.tokens, budget.lengths, positions, step.slots,
                                     budget.choice.rows, runner.scratch_slot)
    bucket = step.tier_context.request_bucket
    greedy, hidden = runner.verify_forward(runner.binding_key(bucket, budget.choice.rows),
                                           runner.verify_inputs(packed, step.slots, bucket))
    grid = gather_target_tokens(greedy, packed.row_offsets, runner.draft_width)
    acceptance = runner.kernels.accept(proposal.tokens, budget.lengths, grid)
    if hidden is not None and step.policy.uses_draft:
        # the draft's context learns the target's view of every real row (draft-off steps
        # included, so drafting can resume at any step); the runner queues them and writes
        # them before the next proposal. Rejected rows sit past the new anchor and are
        # overwritten before they are ever attended. The tier's padding rows go along (no
        # host read to cut them off): they sit on the scratch slot, which no proposal reads
        runner.extend_draft_context(hidden, packed.positions, packed.row_slots)
    return Verification(packed, acceptance)


def commit(step: DecodeStep, verification: Verification) -> None:
    """Write committed tokens (accepted drafts + bonus) and the next anchors into slot storage."""
    storage, acceptance = step.storage, verification.acceptance
    commit_tokens(storage.output_tokens, storage.output_lengths, step.slots, acceptance)
    storage.last_token[step.slots] = acceptance.committed.gather(1, acceptance.accepted.unsqueeze(1)).squeeze(1)
    storage.seq_len[step.slots] += acceptance.accepted + 1


def collect(proposal: Proposal, budget: Budget, verification: Verification) -> StepResult:
    """The one device-to-host copy of a step, taken when its results are ready."""
    acceptance = verification.acceptance
    return StepResult(acceptance.accepted.tolist(), acceptance.committed.tolist(), budget.lengths.tolist(),
                      proposal.confidences.cpu().numpy().astype(np.float64), budget.choice)


R = TypeVar("R")


def _plugin_first(hook: Callable[..., R | None], core: Callable[..., R]) -> Callable[..., R]:
    """A stage that asks the plugins first and runs the core's own when none of them answers."""

    def stage(*args: object) -> R:
        result = hook(*args)
        return core(*args) if result is None else result

    return stage


class StepStages:
    """The four stages of a decode step as the engine runs them, resolved once from the plugins.

    A stage whose hook no registered plugin implements is the core function
    itself (the default path calls it directly). Otherwise the plugins answer
    first and the core's stage runs only when they all return None. The core's
    commit always runs; plugins implementing ``dspark_commit`` run after it.
    """

    def __init__(self, hooks: Hooks) -> None:
        self.propose: Callable[[DecodeStep], Proposal] = (
            _plugin_first(hooks.propose, propose) if hooks.implements("dspark_propose") else propose)
        self.select_budget: Callable[[DecodeStep, Proposal], Budget] = (
            _plugin_first(hooks.select_budget, select_budget) if hooks.implements("dspark_select_budget")
            else select_budget)
        self.verify: Callable[[DecodeStep, Proposal, Budget], Verification] = (
            _plugin_first(hooks.verify, verify) if hooks.implements("dspark_verify") else verify)
        self.observe_commit = hooks.commit if hooks.implements("dspark_commit") else None

    def run(self, step: DecodeStep) -> StepResult:
        """Propose, select the budget, verify and commit one step on the calling thread; its host copy."""
        proposal = self.propose(step)
        budget = self.select_budget(step, proposal)
        verification = self.verify(step, proposal, budget)
        commit(step, verification)
        if self.observe_commit is not None:
            self.observe_commit(step, verification)
        return collect(proposal, budget, verification)
