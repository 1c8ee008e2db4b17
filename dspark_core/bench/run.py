"""Policies side by side on one engine: same prompts, same calibration, interleaved runs.

Every (policy, concurrency) cell runs a closed loop: ``concurrency`` requests
in flight, a new one admitted as soon as one finishes. Prompts are split into
rounds; in each round every policy runs that round's prompts, in an order
rotated per round, so machine drift hits all policies alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from attrs import define, field

from dspark_core.engine.records import StepReport
from dspark_core.engine.request import SamplingParams


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
    model_seconds: float = 0.0  # calibrated cost of the steps this policy ran
    oracle_seconds: float = 0.0  # calibrated cost had each step verified exactly what was accepted
    model_steps_covered: int = 0


def smallest_tier_cost(report: StepReport, rows: int) -> float | None:
    """Calibrated seconds of the smallest captured tier holding ``rows`` (None when unknown)."""
    if report.tier_costs is None:
        return None
    for tier, cost in zip(report.tiers, report.tier_costs):
        if tier >= rows and np.isfinite(cost):
            return float(cost)
    return None


def run_cell(engine, policy, prompts: Sequence[Any], indices: Sequence[int], concurrency: int, max_tokens: int,
             cell: CellRecord) -> None:
    """Decode ``prompts[i] for i in indices`` with at most ``concurrency`` in flight; append to ``cell``."""
    engine.policy = policy
    params = SamplingParams(max_tokens=max_tokens)
    pending = list(indices)
    live: dict[str, tuple[Any, RequestRecord]] = {}

    def observe(report: StepReport) -> None:
        cell.steps += 1
        cell.fallback_steps += int(report.fallback)
        model = smallest_tier_cost(report, report.target_rows)
        oracle = smallest_tier_cost(report, report.request_bucket + sum(report.accepted))
        if model is not None and oracle is not None:
            cell.model_seconds += model
            cell.oracle_seconds += oracle
            cell.model_steps_covered += 1

    engine.add_observer(observe)
    started = time.perf_counter()
    try:
        while pending or live:
            while pending and len(live) < concurrency:
                index = pending.pop(0)
                request = engine.add_request(prompts[index], params)
                live[request.request_id] = (request, RequestRecord(index, time.perf_counter()))
            finished = {o.request_id: o for o in engine.step()}
            now = time.perf_counter()
            for request_id, (request, record) in list(live.items()):
                if record.first_token is None and request.output:
                    record.first_token = now
                output = finished.get(request_id)
                if output is not None:
                    record.finished = now
                    record.first_token = record.first_token or now
                    record.token_ids = output.token_ids
                    record.verified = request.stats.drafted_verified
                    record.accepted = request.stats.drafted_accepted
                    record.steps = request.stats.steps
                    record.verify_widths = list(request.stats.verify_widths)
                    cell.requests.append(record)
                    del live[request_id]
    finally:
        engine.remove_observer(observe)
    cell.wall_seconds += time.perf_counter() - started


def run_benchmark(engine, policies: dict[str, Any], prompts: Sequence[Any], concurrencies: Sequence[int],
                  prompts_per_concurrency: Sequence[int], max_tokens: int, rounds: int,
                  progress: Callable[[str], None] | None = None) -> list[CellRecord]:
    """Every policy at every concurrency, interleaved by rounds."""
    cells: list[CellRecord] = []
    names = list(policies)
    for concurrency, count in zip(concurrencies, prompts_per_concurrency, strict=True):
        indices = list(range(min(count, len(prompts))))
        # a round needs at least `concurrency` prompts, or it would not reach that concurrency
        chunks = [c for c in np.array_split(indices, max(1, min(rounds, len(indices) // concurrency))) if len(c)]
        by_name = {name: CellRecord(name, concurrency) for name in names}
        for r, chunk in enumerate(chunks):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                run_cell(engine, policies[name], prompts, [int(i) for i in chunk], concurrency, max_tokens,
                         by_name[name])
                if progress is not None:
                    progress(f"c={concurrency} round {r + 1}/{len(chunks)} {name}")
        cells.extend(by_name.values())
    return cells
