"""Policies side by side in turns: one engine per policy, one decode step each, in a shuffled order.

``dspark-core bench`` runs every (policy, concurrency) cell on one engine, one
cell after another, so a cell lasts a minute or more and a slow stretch of a
shared machine falls on whichever policy is running then (rounds moved the
ratios by 10-20 % on the project's 2-core CPU). With ``--interleave`` every
policy gets an engine of its own (same target weights and cost table, its own
KV cache and draft instance) and the engines take turns one ``step()`` at a
time, so a burst of noise lands on every policy within a few hundred
milliseconds of each other. The order is shuffled every turn
(:func:`~dspark_core.bench.run.turn_order`): an engine that always followed the
same neighbour would always find that neighbour's shapes warm, or pay for new
ones first.

Each engine keeps its own clock, which only runs during its own steps: a
request is submitted, gets its first token and finishes at that clock's
readings, so throughput, TPOT and TTFT are what the policy would have measured
alone. The engines run without schedule overlap (a step's work must end inside
its own turn, or it would run during another engine's), so the figures compare
policies, not what overlap buys; the default mode measures the served setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dspark_core.bench.run import WARMUP_TOKENS, CellRecord, ClosedLoop, run_cell, sweep, turn_order
from dspark_core.policy import BudgetPolicy


def run_interleaved(engines: dict[str, Any], policies: dict[str, Any], prompts: Sequence[Any],
                    concurrencies: Sequence[int], prompts_per_concurrency: Sequence[int], max_tokens: int,
                    rounds: int, progress: Callable[[str], None] | None = None,
                    warmup: BudgetPolicy | None = None, copies: dict[str, bool] | None = None,
                    finished: Callable[[int], None] | None = None) -> list[CellRecord]:
    """Every policy at every concurrency, each on ``engines[label]``, stepping in turns.

    ``engines`` and ``policies`` share their labels; every engine must be built without schedule
    overlap. A round runs every policy once over the same prompts, all at the same time; the
    arguments otherwise mean what they mean for :func:`~dspark_core.bench.run.run_benchmark`, and
    so does the result (one pooled cell per label and concurrency, its rounds inside).
    ``finished(n)`` hears of every ``n`` measured requests that end (a round lasts minutes: a progress
    bar can follow requests).
    """
    if set(engines) != set(policies):
        raise ValueError(f"one engine per policy: engines {sorted(engines)}, policies {sorted(policies)}")
    overlapped = [label for label, engine in engines.items() if engine.queue.depth != 1]
    if overlapped:
        raise ValueError(f"interleaved engines must run without schedule overlap: {overlapped}")
    names = list(policies)

    def warm_up(indices: list[int], concurrency: int) -> None:  # every engine's first prefill of the batch shapes
        if warmup is not None:
            for name in names:
                run_cell(engines[name], warmup, prompts, indices, concurrency, WARMUP_TOKENS,
                         CellRecord("warmup", concurrency))

    def one_round(r: int, indices: list[int], concurrency: int) -> Iterable[tuple[str, CellRecord]]:
        cells = _one_round(engines, policies, names, prompts, indices, concurrency, max_tokens, copies, finished,
                           run=f"c{concurrency}r{r}")
        if progress is not None:
            progress(f"c={concurrency} round {r + 1}/{rounds} (interleaved)")
        return cells.items()

    return sweep(names, len(prompts), concurrencies, prompts_per_concurrency, rounds, warm_up, one_round)


def _one_round(engines: dict[str, Any], policies: dict[str, Any], names: list[str], prompts: Sequence[Any],
               indices: list[int], concurrency: int, max_tokens: int,
               copies: dict[str, bool] | None, finished: Callable[[int], None] | None,
               run: str = "") -> dict[str, CellRecord]:
    loops = {name: ClosedLoop(engines[name], policies[name], prompts, indices, concurrency, max_tokens,
                              CellRecord(name, concurrency), None if copies is None else copies[name])
             for name in names}
    clocks = dict.fromkeys(names, 0.0)  # seconds each engine has spent in its own steps
    turn = 0
    try:
        while not all(loop.done for loop in loops.values()):
            for name in turn_order(names, turn, run):  # shuffled every turn, differently every round
                loop = loops[name]
                if loop.done:
                    continue
                loop.admit(clocks[name])
                started = time.perf_counter()
                outputs = engines[name].step()
                clocks[name] += time.perf_counter() - started
                before = len(loop.cell.requests)
                loop.collect(outputs, clocks[name])
                if finished is not None and len(loop.cell.requests) > before:
                    finished(len(loop.cell.requests) - before)
            turn += 1
    finally:
        for loop in loops.values():
            loop.close()
    for name, loop in loops.items():
        loop.cell.wall_seconds = clocks[name]
    return {name: loop.cell for name, loop in loops.items()}
