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
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from attrs import define, frozen

from dspark_core.engine.runner import ModelRunner, pack_host_result, pad_to
from dspark_core.engine.slots import SlotStorage
from dspark_core.plugins import Hooks
from dspark_core.policy import (BudgetPolicy, TierChoice, TierContext, allocate_split, check_choice, copy_step_choice,
                                draft_off_choice, reads_confidences, split_rows)
from dspark_kernels.accept_commit import Acceptance
from dspark_kernels.pack import PackedRows


@frozen
class Proposal:
    """The drafted block of every running request."""

    tokens: torch.Tensor  # [n, K] int64
    confidences: torch.Tensor  # [n, K] float32
    # the same padded to the request bucket (the proposal key's whole outputs; ``tokens`` and
    # ``confidences`` are their first n rows), so the verify key takes them without a copy.
    # None: only the n rows exist (an eager proposal)
    bucket_tokens: torch.Tensor | None = None
    bucket_confidences: torch.Tensor | None = None


@frozen
class Budget:
    """The chosen tier and each request's verify length."""

    choice: TierChoice
    # [n] int64; None: the core's verify splits the tier's draft rows inside its graph key (the
    # policy's split is :func:`~dspark_core.policy.allocate_split`) and reports the lengths it used
    lengths: torch.Tensor | None


@frozen
class Verification:
    """What the target decided for this step."""

    packed: PackedRows
    acceptance: Acceptance
    # True: already written to slot storage (the core's verify commits inside its graph key)
    committed: bool = False
    # the verify length of each request [n] (None: the budget's own)
    lengths: torch.Tensor | None = None
    # [n, 2 + (K+1) + K] float64 packed by the core's verify key: accepted, length, committed tokens,
    # confidences (what collect copies to the host); None: collect packs them itself
    host_result: torch.Tensor | None = None

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
    # slots and caps padded to the request bucket (the scratch slot, cap -1), built on the host in one
    # copy each, so the keys' inputs need no padding on the device; ``slots`` and ``caps`` are their
    # first n entries. None: pad when a key needs them
    bucket_slots: torch.Tensor | None = None
    bucket_caps: torch.Tensor | None = None
    # the same caps as the host built them, so the tier decision reads nothing back from the device
    # (None: copy ``caps`` back, one device-to-host read)
    host_caps: np.ndarray | None = None
    # Confidences the host had when it scheduled the step, exactly ``tier_lag`` steps old;
    # None: decide the tier on this step's own proposal (lag 0).
    tier_confidences: np.ndarray | None = None
    # False: a draft-off step (the policy's plan): no proposal, one target row per request
    draft: bool = True
    # a draft-off step that still looks up copy proposals (no draft forward) and verifies them where
    # they pay (see :func:`~dspark_core.policy.copy_step_choice`); only with ``draft`` False
    copy_only: bool = False
    index: int = 0  # the engine's decode-step counter when the step was built
    # KV positions the step's keys read per slot (0: the whole cache): every position it may touch
    # is below it (ModelRunner.span_for)
    kv_span: int = 0
    # tokens the draft proposes (ModelRunner.depth_for; 0: all K)
    draft_depth: int = 0
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
    # wall seconds the step took on the thread that ran it, up to and including its result copy
    # (set by Engine.decode_on_device; None where nobody timed it)
    seconds: float | None = None

    @property
    def drafted(self) -> bool:
        """Whether the draft proposed this step's block: False for a draft-off step and a copy step
        (their confidences are zeros or copies, not the draft's)."""
        return not (self.choice.draft_off or self.choice.copy_only)


def propose(step: DecodeStep) -> Proposal:
    """Draft K tokens per request (zeros when the policy runs no draft, or not this step)."""
    n, width = step.slots.shape[0], step.runner.draft_width
    rows = n if step.bucket_slots is None else step.bucket_slots.shape[0]
    if step.copy_only and not step.draft:
        bucket = step.tier_context.request_bucket
        slots = step.bucket_slots if step.bucket_slots is not None else pad_to(step.slots, bucket, step.runner.scratch_slot)
        copied, copy_confidences = step.runner.copy_bucket(slots, bucket)
        return Proposal(copied[:n], copy_confidences[:n], copied, copy_confidences)
    if not step.draft or not step.policy.uses_draft:
        zeros = torch.zeros(rows, width, dtype=torch.int64, device=step.slots.device)
        zero_confidences = torch.zeros(rows, width, dtype=torch.float32, device=step.slots.device)
        return Proposal(zeros[:n], zero_confidences[:n], zeros, zero_confidences)
    bucket, depth = step.tier_context.request_bucket, step.draft_depth or None
    if step.bucket_slots is not None and step.runner.graphs is not None:
        bucket_tokens, bucket_confidences = step.runner.propose_bucket(step.bucket_slots, bucket, step.kv_span, depth)
        bucket_confidences = bucket_confidences.float()
        tokens, confidences = bucket_tokens[:n], bucket_confidences[:n]
    else:
        tokens, confidences = step.runner.propose_from_storage(step.slots, bucket, step.kv_span, depth)
        confidences, bucket_tokens, bucket_confidences = confidences.float(), None, None
    if step.proposal_ready is not None:
        step.proposal_ready.set_result(confidences.cpu().numpy().astype(np.float64))
    return Proposal(tokens, confidences, bucket_tokens, bucket_confidences)


def select_budget(step: DecodeStep, proposal: Proposal, *, split_in_verify: bool = False) -> Budget:
    """Tier from the host's (possibly older) confidences; split with the current ones.

    ``split_in_verify`` (the core's verify runs the step): a policy whose split is
    :func:`~dspark_core.policy.allocate_split` leaves it to the verify key (``Budget.lengths`` None).
    """
    policy = step.policy
    if not step.draft and not step.copy_only:  # the plan turned the draft off: anchors only, nothing to split
        return Budget(draft_off_choice(step.tier_context), torch.zeros_like(step.caps))
    caps = step.host_caps if step.host_caps is not None else step.caps.cpu().numpy()
    if step.copy_only:  # the draft is off; the copies the step found are priced on their own
        # a multi-rank wrapper decides (rank 0) or receives the decision (workers) through
        # choose_copy_tier / copy_split, and every outcome goes through its split, draft-off too
        choose = getattr(policy, "choose_copy_tier", copy_step_choice)
        choice = choose(step.tier_context, proposal.confidences.cpu().numpy().astype(np.float64), caps)
        split = getattr(policy, "copy_split", allocate_split)
        if choice.draft_off and split is allocate_split:
            return Budget(choice, torch.zeros_like(step.caps))
    else:
        tier_confidences = step.tier_confidences
        if tier_confidences is None and not reads_confidences(policy):
            # the choice depends on the caps alone: launch the verify without waiting for the proposal
            tier_confidences = np.empty((step.slots.shape[0], 0))
        elif tier_confidences is None:
            tier_confidences = proposal.confidences.cpu().numpy().astype(np.float64)
        choice = check_choice(policy, step.tier_context, policy.choose_tier(step.tier_context, tier_confidences, caps))
        split = policy.split
    if split_in_verify and choice.lengths is None and split is allocate_split:
        return Budget(choice, None)  # the allocate kernel runs inside the verify key
    lengths = split(step.runner.kernels, proposal.confidences, step.caps, choice, step.tier_context.request_bucket)
    return Budget(choice, lengths)


def verify(step: DecodeStep, proposal: Proposal, budget: Budget) -> Verification:
    """Pack the tier's rows, run the target once, accept the longest matching prefixes and commit them.

    The runner does all of it as the (bucket, tier) key of the graph backend, so the commit is part of
    this stage here (``Verification.committed``); a plugin's verify leaves it to :func:`commit`.
    """
    bucket, choice = step.tier_context.request_bucket, budget.choice
    draft_rows = -1 if budget.lengths is not None else split_rows(choice, bucket)
    packed, acceptance, lengths, host_result = step.runner.verify_commit(
        _padded_or(proposal.bucket_tokens, proposal.tokens), budget.lengths,
        _padded_or(step.bucket_slots, step.slots), bucket, choice.rows,
        confidences=_padded_or(proposal.bucket_confidences, proposal.confidences),
        caps=_padded_or(step.bucket_caps, step.caps), draft_rows=draft_rows, queue_context=step.policy.uses_draft,
        live=step.slots.shape[0], drafted=step.draft and step.policy.uses_draft, kv_span=step.kv_span)
    return Verification(packed, acceptance, committed=True, lengths=lengths, host_result=host_result)


def _padded_or(padded: torch.Tensor | None, own: torch.Tensor) -> torch.Tensor:
    """The bucket-padded tensor where the step has one (no padding copy on the device), else the
    requests' own rows, which the verify key's staging pads."""
    return own if padded is None else padded


def commit(step: DecodeStep, verification: Verification) -> None:
    """Write committed tokens (accepted drafts + bonus) and the next anchors into slot storage."""
    step.storage.commit(step.slots, verification.acceptance)


def collect(proposal: Proposal, budget: Budget, verification: Verification) -> StepResult:
    """The one device-to-host copy of a step, taken when its results are ready.

    Accepted counts, verify lengths, committed tokens and confidences go back as one float64
    tensor (token ids and counts are exact in float64), so the host waits for the device once. The
    core's verify key packs that tensor itself; for a plugin's verify it is packed here.
    """
    width = proposal.confidences.shape[1]
    if verification.host_result is not None:
        # a copy, also where .cpu() returns the key's own output buffer, which the next replay overwrites
        host = np.array(verification.host_result.cpu().numpy())
    else:
        lengths = verification.lengths if verification.lengths is not None else budget.lengths
        assert lengths is not None, "a budget without lengths is verified by the core's verify, which reports them"
        host = pack_host_result(verification.acceptance, lengths, proposal.confidences).cpu().numpy()
    ints = host[:, : width + 3].astype(np.int64)
    return StepResult(ints[:, 0].tolist(), ints[:, 2:].tolist(), ints[:, 1].tolist(), host[:, width + 3:], budget.choice)


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
    commit always runs (inside the core's verify, or after a plugin's); plugins
    implementing ``dspark_commit`` run after it.
    """

    def __init__(self, hooks: Hooks) -> None:
        self.propose: Callable[[DecodeStep], Proposal] = (
            _plugin_first(hooks.propose, propose) if hooks.implements("dspark_propose") else propose)
        # with the core's verify, the default split runs inside its graph key; a plugin's verify
        # gets the lengths in the budget
        core_verify = not hooks.implements("dspark_verify")
        core_budget = partial(select_budget, split_in_verify=core_verify)
        self.select_budget: Callable[[DecodeStep, Proposal], Budget] = (
            _plugin_first(hooks.select_budget, core_budget) if hooks.implements("dspark_select_budget")
            else core_budget)
        self.verify: Callable[[DecodeStep, Proposal, Budget], Verification] = (
            verify if core_verify else _plugin_first(hooks.verify, verify))
        self.observe_commit = hooks.commit if hooks.implements("dspark_commit") else None

    def run(self, step: DecodeStep) -> StepResult:
        """Propose, select the budget, verify and commit one step on the calling thread; its host copy."""
        proposal = self.propose(step)
        budget = self.select_budget(step, proposal)
        verification = self.verify(step, proposal, budget)
        if not verification.committed:
            commit(step, verification)
        if self.observe_commit is not None:
            self.observe_commit(step, verification)
        return collect(proposal, budget, verification)
