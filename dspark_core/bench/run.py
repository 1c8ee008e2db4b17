"""Policies side by side on one engine: same prompts, same calibration, interleaved runs.

Every (policy, concurrency) cell runs a closed loop: ``concurrency`` requests
in flight, a new one admitted as soon as one finishes. A concurrency is run in
``rounds`` rounds; every round runs every policy on the same prompts, and the
policy order is rotated by a different offset each round (no policy is always
first or always after the same neighbour), so machine drift hits all policies
alike and the spread of a ratio over the rounds shows how noisy it is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from attrs import define, field

from dspark_core.engine.records import StepReport
from dspark_core.engine.request import SamplingParams
from dspark_core.policy import BudgetPolicy


@define
class RequestRecord:
    """One benchmarked request: timings on the host, and its committed tokens."""

    prompt_index: int
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    token_ids: tuple[int, ...] = ()
    verified: int = 0
    accepted: int = 0
    steps: int = 0
    verify_widths: list[int] = field(factory=list)


@define
class CellRecord:
    """Everything measured for one (policy, concurrency) cell."""

    policy: str
    concurrency: int
    requests: list[RequestRecord] = field(factory=list)
    wall_seconds: float = 0.0
    steps: int = 0
    fallback_steps: int = 0
    draft_off_steps: int = 0  # steps that ran no draft (copy steps included)
    copy_steps: int = 0  # draft-off steps that verified copy proposals
    model_seconds: float = 0.0  # calibrated cost of the steps this policy ran
    oracle_seconds: float = 0.0  # calibrated cost had each step verified exactly what was accepted
    model_steps_covered: int = 0
    uses_draft: bool = True  # False: target-only; its model/oracle figures would price a draft it never ran
    # measured seconds of each decode step's device work (StepReport.step_seconds), drafted steps and
    # draft-off ones (copy steps included) apart: what the steps cost here, beside what the table said
    drafted_step_seconds: list[float] = field(factory=list)
    off_step_seconds: list[float] = field(factory=list)
    # the policy's forecast of committed tokens summed over the steps that had one, and what those
    # steps really committed (bonus tokens included)
    predicted_tokens: float = 0.0
    forecast_committed: int = 0
    forecast_steps: int = 0
    rounds: list[CellRecord] = field(factory=list)  # the per-round cells this one pools (empty: one round)

    def per_round(self) -> list[CellRecord]:
        """The cell of every round (the cell itself when it was measured in one)."""
        return self.rounds or [self]


def pool(policy: str, concurrency: int, rounds: Sequence[CellRecord]) -> CellRecord:
    """One cell holding the sum of ``rounds`` (requests, wall time, counters) and the rounds themselves."""
    cell = CellRecord(policy, concurrency, rounds=list(rounds))
    for part in rounds:
        cell.requests += part.requests
        cell.uses_draft = part.uses_draft
        cell.drafted_step_seconds += part.drafted_step_seconds
        cell.off_step_seconds += part.off_step_seconds
        for name in ("wall_seconds", "steps", "fallback_steps", "draft_off_steps", "copy_steps",
                     "model_seconds", "oracle_seconds",
                     "model_steps_covered", "predicted_tokens", "forecast_committed", "forecast_steps"):
            setattr(cell, name, getattr(cell, name) + getattr(part, name))
    return cell


def smallest_tier_cost(report: StepReport, rows: int) -> float | None:
    """Calibrated seconds of the smallest captured tier holding ``rows`` (None when unknown)."""
    if report.tier_costs is None:
        return None
    for tier, cost in zip(report.tiers, report.tier_costs):
        if tier >= rows and np.isfinite(cost):
            return float(cost)
    return None


def step_model_cost(report: StepReport) -> float | None:
    """Calibrated seconds of the step as it ran: a draft-off step at its draft-free cost."""
    if getattr(report, "draft_off", False):
        cost = getattr(report, "draft_off_cost", None)
        return float(cost) if cost is not None and np.isfinite(cost) else None
    return smallest_tier_cost(report, report.target_rows)


class ClosedLoop:
    """One cell's closed loop of requests on one engine: at most ``concurrency`` in flight, the next
    prompt admitted as soon as one finishes. The caller steps the engine and says what time it is
    (the wall clock, or a clock that only runs during this engine's own steps)."""

    def __init__(self, engine, policy, prompts: Sequence[Any], indices: Sequence[int], concurrency: int,
                 max_tokens: int, cell: CellRecord, copies: bool | None = None) -> None:
        engine.set_policy(policy)
        if copies is not None:
            engine.set_copy_proposals(copies)
        cell.uses_draft = bool(getattr(policy, "uses_draft", True))
        self.engine, self.prompts, self.concurrency, self.cell = engine, prompts, concurrency, cell
        self.params = SamplingParams(max_tokens=max_tokens)
        self.pending = list(indices)
        self.live: dict[str, tuple[Any, RequestRecord]] = {}
        engine.add_observer(self.observe)

    @property
    def done(self) -> bool:
        return not (self.pending or self.live)

    def admit(self, now: float) -> None:
        """Queue prompts until ``concurrency`` requests are in flight (submitted at ``now``)."""
        while self.pending and len(self.live) < self.concurrency:
            index = self.pending.pop(0)
            request = self.engine.add_request(self.prompts[index], self.params)
            self.live[request.request_id] = (request, RequestRecord(index, now))

    def collect(self, finished: Sequence[Any], now: float) -> None:
        """Stamp first tokens and finished requests of the step that ended at ``now``."""
        by_id = {o.request_id: o for o in finished}
        for request_id, (request, record) in list(self.live.items()):
            if record.first_token is None and request.output:
                record.first_token = now
            output = by_id.get(request_id)
            if output is not None:
                record.finished = now
                record.first_token = record.first_token or now
                record.token_ids = output.token_ids
                record.verified = request.stats.drafted_verified
                record.accepted = request.stats.drafted_accepted
                record.steps = request.stats.steps
                record.verify_widths = list(request.stats.verify_widths)
                self.cell.requests.append(record)
                del self.live[request_id]

    def observe(self, report: StepReport) -> None:
        """The engine's observer: count the step and price it by the table."""
        cell = self.cell
        cell.steps += 1
        cell.fallback_steps += int(report.fallback)
        cell.draft_off_steps += int(report.draft_off)
        cell.copy_steps += int(report.copy_only)
        if np.isfinite(report.predicted_tokens):
            cell.predicted_tokens += float(report.predicted_tokens)
            cell.forecast_committed += report.committed_tokens
            cell.forecast_steps += 1
        if report.step_seconds is not None:
            drafted = report.drafted and cell.uses_draft
            (cell.drafted_step_seconds if drafted else cell.off_step_seconds).append(report.step_seconds)
        model = step_model_cost(report)
        oracle = smallest_tier_cost(report, report.request_bucket + sum(report.accepted))
        if model is not None and oracle is not None:
            cell.model_seconds += model
            cell.oracle_seconds += oracle
            cell.model_steps_covered += 1

    def close(self) -> None:
        self.engine.remove_observer(self.observe)


def run_cell(engine, policy, prompts: Sequence[Any], indices: Sequence[int], concurrency: int, max_tokens: int,
             cell: CellRecord, copies: bool | None = None) -> None:
    """Decode ``prompts[i] for i in indices`` with at most ``concurrency`` in flight; append to ``cell``.
    ``copies`` True/False turns the engine's copy proposals on/off first (None: as they are)."""
    loop = ClosedLoop(engine, policy, prompts, indices, concurrency, max_tokens, cell, copies)
    started = time.perf_counter()
    try:
        while not loop.done:
            loop.admit(time.perf_counter())
            finished = engine.step()
            loop.collect(finished, time.perf_counter())
    finally:
        loop.close()
    cell.wall_seconds += time.perf_counter() - started


def round_order(names: Sequence[str], round_index: int, rounds: int) -> list[str]:
    """The policy order of one round: ``names`` rotated by an offset spread evenly over the rounds."""
    names = list(names)
    offset = (round_index * len(names)) // max(rounds, 1) % max(len(names), 1)
    return names[offset:] + names[:offset]


def turn_order(names: Sequence[str], turn: int, run: str = "") -> list[str]:
    """The order engines step in on ``turn`` of a run in turns: a permutation of ``names`` drawn from a
    generator seeded by ``run`` (which names the run, e.g. its round) and the turn, so it is
    reproducible and every engine's neighbours change from turn to turn. An engine runs a little
    faster right after one that ran the same shapes (kernel primitives and caches are warm), and the
    first to meet a new shape pays its one-time costs; under a fixed order or a rotation by one, those
    effects fall on the same engines every turn (identical engines then differed by up to 4.5 %)."""
    order = list(names)
    random.Random(f"{run}:{turn}").shuffle(order)  # (a str seed is hashed with sha512: stable across processes)
    return order


WARMUP_TOKENS = 8


def run_benchmark(engine, policies: dict[str, Any], prompts: Sequence[Any], concurrencies: Sequence[int],
                  prompts_per_concurrency: Sequence[int], max_tokens: int, rounds: int,
                  progress: Callable[[str], None] | None = None,
                  warmup: BudgetPolicy | None = None, copies: dict[str, bool] | None = None) -> list[CellRecord]:
    """Every policy at every concurrency, ``rounds`` times over the same prompts in rotated orders.

    With a ``warmup`` policy (a stateless one: the bench passes target-only), each concurrency
    first runs its prompts once, untimed, for ``WARMUP_TOKENS`` tokens: the first prefill of a
    new batch shape pays one-off costs (the allocator growing, large buffers touched for the
    first time: 0.6-0.7 s of a 4.7 s prefill of 16 MT-Bench prompts on the project's CPU) that
    would otherwise be billed to whichever policy runs first in round one.

    With ``copies`` (label -> on/off), each cell first turns the engine's copy proposals on or off.

    Returns one pooled cell per (policy, concurrency); its ``rounds`` hold the cell of each round.
    """
    names = list(policies)

    def warm_up(indices: list[int], concurrency: int) -> None:
        if warmup is not None:
            run_cell(engine, warmup, prompts, indices, concurrency, WARMUP_TOKENS, CellRecord("warmup", concurrency))

    def one_round(r: int, indices: list[int], concurrency: int) -> Iterator[tuple[str, CellRecord]]:
        for name in round_order(names, r, rounds):
            cell = CellRecord(name, concurrency)
            run_cell(engine, policies[name], prompts, indices, concurrency, max_tokens, cell,
                     None if copies is None else copies[name])
            if progress is not None:
                progress(f"c={concurrency} round {r + 1}/{rounds} {name}")
            yield name, cell

    return sweep(names, len(prompts), concurrencies, prompts_per_concurrency, rounds, warm_up, one_round)


def sweep(names: Sequence[str], prompt_count: int, concurrencies: Sequence[int], prompts_per_concurrency: Sequence[int],
          rounds: int, warm_up: Callable[[list[int], int], None],
          one_round: Callable[[int, list[int], int], Iterable[tuple[str, CellRecord]]]) -> list[CellRecord]:
    """The shape both bench modes share: at every concurrency, its first prompts (up to the count
    asked for), ``warm_up(indices, concurrency)`` untimed, then ``rounds`` calls of
    ``one_round(r, indices, concurrency)``, each giving every policy's ``(name, cell)`` of that round;
    returns one pooled cell per (name, concurrency)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    cells: list[CellRecord] = []
    for concurrency, count in zip(concurrencies, prompts_per_concurrency, strict=True):
        indices = list(range(min(count, prompt_count)))
        warm_up(indices, concurrency)
        by_name: dict[str, list[CellRecord]] = {name: [] for name in names}
        for r in range(rounds):
            for name, cell in one_round(r, indices, concurrency):
                by_name[name].append(cell)
        cells.extend(pool(name, concurrency, by_name[name]) for name in names)
    return cells
