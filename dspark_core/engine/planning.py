"""Building a decode step on the host: tier context, the policy's plan, confidences of the right age.

The engine calls :meth:`StepPlanner.build` for the running requests (with
schedule overlap, while the previous step still runs) and
:meth:`StepPlanner.record_population` when it processes a drafted step. The planner keeps
what the host knows of drafted confidences: each request's own history and the
batch's recent mean blocks (what a request that has not drafted yet is
assumed to look like).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future

import attrs
import numpy as np

from dspark_core.device import host_to_device
from dspark_core.engine.costs import TierCosts
from dspark_core.engine.request import Request
from dspark_core.engine.runner import ModelRunner
from dspark_core.engine.slots import SlotStorage
from dspark_core.engine.step import DecodeStep
from dspark_core.geometry import Geometry, kv_reserve
from dspark_core.policy import BudgetPolicy, TierContext, plan_step, verifies_past_depth


class StepPlanner:
    """Host-side preparation of decode steps and the confidence history they read."""

    def __init__(self, geometry: Geometry, costs: TierCosts, runner: ModelRunner, storage: SlotStorage) -> None:
        self.geometry = geometry
        self.costs = costs
        self.runner = runner
        self.storage = storage
        self.width = geometry.draft_width
        self.decode_index = 0  # decode steps built so far; a step's confidences are keyed by it
        # the newest launched decode step and its requests (for the lag-1 early proposal)
        self.last_decode: tuple[DecodeStep, list[Request]] | None = None
        # (step index, mean confidences over the step's requests) of recent drafted steps: what a
        # request without a drafted block of its own is assumed to look like
        self.population: deque[tuple[int, np.ndarray]] = deque(maxlen=4)

    def build(self, running: list[Request], policy: BudgetPolicy, queue_depth: int,
              pending: Mapping[Request, int] | None = None) -> DecodeStep:
        """The next decode step for ``running`` (overlaps the previous step's execution).

        The tier is chosen from confidences exactly ``tier_lag`` steps old. What
        the host can see without waiting depends on schedule overlap
        (``queue_depth`` 2): without it every earlier step is processed (age >= 1
        is free); with it the previous step is still running, so age 2 is free,
        age 1 waits for that step's proposal (not its verify), and age 0 is
        decided inside the step itself.

        ``pending`` gives the tokens each request's launched but unprocessed work commits
        at least; the caps leave room for them.
        """
        width, n = self.width, len(running)
        index = self.decode_index
        self.decode_index += 1
        bucket = self.geometry.bucket_for(n)
        assert bucket is not None, "the scheduler runs at most the largest bucket's requests"
        kv = max(r.length for r in running) + kv_reserve(width)
        tiers = self.geometry.rows_for(bucket)
        depth = self.runner.depth_for(bucket, policy)
        # verifying past max_tokens is wasted work: the bonus token always commits, and so does at
        # least one token of each launched step the host has not processed yet
        pending = pending or {}
        cap_values = np.array([max(0, min(width, r.remaining - 1 - pending.get(r, 0))) for r in running],
                              dtype=np.int64)
        if depth < width and not verifies_past_depth(policy):
            # copies fill all K positions, but a request verifying past the depth makes an attention
            # band of its own on the CPU, which the table's price by rows does not hold
            cap_values = np.minimum(cap_values, depth)
        if self.runner.forwards_live_rows:  # priced by the rows the forward runs, not the padded tier
            tier_costs, draft_off_cost = self.costs.for_live(bucket, kv, n, int(cap_values.sum()))
        else:
            tier_costs, draft_off_cost = self.costs.for_step(bucket, kv), self.costs.draft_off_for_step(bucket, kv)
        if bucket not in tiers:
            draft_off_cost = None
        ctx = TierContext(bucket, n, width, tiers, tier_costs, draft_off_cost)
        device = self.runner.device
        lag = policy.tier_lag
        if lag == 1:
            self._take_early_proposal(index - 1)
        # the plan (draft or not) uses the freshest confidences the host holds; with lag >= 1
        # that is exactly the tier's input, with lag 0 the step's own proposal does not exist yet
        known = np.stack([self.confidences_up_to(r, index - max(lag, 1)) for r in running])
        if depth < width:  # older confidences may come from a step that proposed more: nothing past the depth exists
            known[:, depth:] = 0.0
        plan = plan_step(policy, ctx, known, cap_values)
        ctx = attrs.evolve(ctx, forecast_scale=plan.forecast_scale)
        # slots and caps go to the device once, already padded to the bucket (the scratch slot, cap -1):
        # the keys take them as they are, and the step's own views are their first n entries
        padding = bucket - n
        bucket_slots = host_to_device([r.slot for r in running] + [self.runner.scratch_slot] * padding, device)
        bucket_caps = host_to_device(np.concatenate([cap_values, np.full(padding, -1, dtype=np.int64)]), device)
        # a draft-off step still looks for copies when the policy asks for copy steps
        copy_only = not plan.draft and self.runner.copies_on and bool(getattr(policy, "copy_steps", False))
        step = DecodeStep(self.runner, self.storage, policy, ctx, bucket_slots[:n], bucket_caps[:n],
                          host_caps=cap_values, draft=plan.draft, copy_only=copy_only, index=index,
                          bucket_slots=bucket_slots, bucket_caps=bucket_caps, kv_span=self.runner.span_for(kv),
                          draft_depth=depth if plan.draft else 0)
        if lag > 0:
            step.tier_confidences = known
        if plan.draft and queue_depth > 1 and lag == 1:  # the next step will wait for this proposal
            step.proposal_ready = Future()
        self.last_decode = (step, running)
        return step

    def _take_early_proposal(self, index: int) -> None:
        """Record step ``index``'s confidences before its results are processed (lag 1 with overlap)."""
        if self.last_decode is None:
            return
        last, requests = self.last_decode
        if last.index != index or last.proposal_ready is None:
            return
        confidences = last.proposal_ready.result()
        for row, request in enumerate(requests):
            remember(request, index, confidences[row])
        self.record_population(index, confidences)

    def confidences_up_to(self, request: Request, index: int) -> np.ndarray:
        """The request's newest drafted confidences from a step no later than ``index``.

        A request with none (it just joined) gets the mean block of the newest
        such step of the whole batch, and only when nothing was drafted yet all
        ones (every drafted token assumed to survive: full width). Assuming full
        survival for every newcomer would make a weak draft run at full width
        on each new request's first steps.
        """
        for history in (request.confidence_history, self.population):
            for step_index, confidences in reversed(history):
                if step_index <= index:
                    return confidences
        return np.ones(self.width)

    def record_population(self, step_index: int, confidences: np.ndarray) -> None:
        """Keep a drafted step's mean block once (the lag-1 path may have delivered it early)."""
        population = self.population
        if len(confidences) and (not population or population[-1][0] != step_index):
            population.append((step_index, np.asarray(confidences, dtype=np.float64).mean(axis=0)))


def remember(request: Request, step_index: int, confidences: np.ndarray) -> None:
    """Keep a step's drafted confidences once (the lag-1 path may have delivered them early)."""
    history = request.confidence_history
    if not history or history[-1][0] != step_index:
        history.append((step_index, confidences))
