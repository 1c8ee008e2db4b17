"""Probing: drive the real engine pipeline on random tokens and time its decode steps.

A *run* admits ``Bcap`` requests of ``prefill_tokens`` random tokens together,
decodes ``warmup_steps`` untimed steps, then times ``window_steps ×
windows_per_point`` consecutive decode intervals with the target rows forced.
Time is read only when a step's results are processed on the host (the
pipeline's own result readiness), never with extra timing events or device
copies. Every timed interval is labelled with the rows of the step that ended
it; windows are cut from a point's intervals after all runs (and, on several
ranks, after the ranks' intervals are combined). Samples stay in memory until
the fit.

``probe_order`` decides how a bucket's drafting rows share those runs:

* ``sequential``: one run per (bucket, rows) point, one point after another.
* ``interleaved``: the bucket's rows take turns step by step in a shuffled
  order, over as many runs as there are rows. On a shared machine the speed
  drifts and stalls come in bursts of several steps; probed one after the
  other, neighbouring row counts then differ by the drift rather than by their
  work (seen here: one request's 2..7 rows measured as falling by 14 ms),
  while interleaved every row count sees the same stretch of time.

Draft-off points always get runs of their own: a drafted step right after a
draft-off one also catches the draft's context up, which is not its price.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import attrs
import numpy as np
import torch
from attrs import define, frozen
from tqdm import tqdm

from dspark_core.audit import get_logger
from dspark_core.calibration.plan import CalibrationPlan, ProbePoint
from dspark_core.costs.base import CostSample
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.policy import StepPlan, TierChoice, TierContext, allocate_split


@define
class ForcedTiers:
    """A budget policy pinned to one bucket's given tiers, drafting or not (calibration only).

    ``begin_run(untimed)`` starts a run: its first ``untimed`` steps of the bucket reuse the
    current row, after that every step takes the next row of ``order``. Steps of another
    bucket happen while the run's requests are still being admitted (the scheduler's prefill
    budget can hold fewer prompts than the bucket, e.g. 64 of 256 tokens against 8 192); they
    are never timed, so they run as plain drafted steps of their own bucket.
    """

    request_bucket: int
    order: Callable[[int], int]  # row count of the bucket's k-th timed step
    draft: bool = True
    cursor: int = 0  # timed steps of this bucket in earlier runs
    calls: int = 0  # steps of the bucket built in this run
    untimed: int = 0
    name: str = "forced-tier"
    uses_draft: bool = True
    tier_lag: int = 0

    def begin_run(self, untimed: int) -> None:
        self.calls, self.untimed = 0, untimed

    def plan(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> StepPlan:
        return StepPlan(draft=self.draft or ctx.request_bucket != self.request_bucket)

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        if ctx.request_bucket != self.request_bucket:
            return TierChoice(min(ctx.tiers))
        rows = self.order(self.cursor + max(self.calls - self.untimed, 0))
        self.calls += 1
        if rows not in ctx.tiers:
            raise ConfigError(f"calibration: {rows} target rows are not captured for bucket {ctx.request_bucket}")
        return TierChoice(rows)

    split = staticmethod(allocate_split)


@frozen
class TimedStep:
    """One timed decode interval: the step that ended it, and its seconds. ``group`` numbers the
    plan's run groups (a sequential point, a draft-off point, or an interleaved bucket's runs):
    windows are cut per group."""

    group: int
    request_bucket: int
    target_rows: int
    context: int
    draft_off: bool
    seconds: float


@frozen
class Run:
    """What one run probes: a bucket in one context, one or several drafting rows, or draft-off."""

    request_bucket: int
    rows: tuple[int, ...]
    context_index: int
    prefill_tokens: int
    draft_off: bool = False

    def describe(self) -> str:
        if self.draft_off:
            return "draft-off"
        return str(self.rows[0]) if len(self.rows) == 1 else f"{self.rows[0]}-{self.rows[-1]} interleaved"


def plan_runs(plan: CalibrationPlan) -> list[tuple[Run, int]]:
    """The plan's points grouped into runs, each with the number of runs it takes (in order)."""
    out: list[tuple[Run, int]] = []
    interleave = plan.settings.probe_order == "interleaved"
    for point in plan.points:
        run = Run(point.request_bucket, (point.target_rows,), point.context_index, point.prefill_tokens, point.draft_off)
        last = out[-1][0] if out else None
        if (interleave and last is not None and not point.draft_off and not last.draft_off
                and (last.request_bucket, last.context_index) == (run.request_bucket, run.context_index)):
            out[-1] = (attrs.evolve(last, rows=(*last.rows, point.target_rows)), out[-1][1] + 1)
        else:
            out.append((run, 1))
    return out


def shuffled_order(rows: Sequence[int], seed: int) -> Callable[[int], int]:
    """Row of the k-th timed step: every ``len(rows)`` steps are a fresh random permutation.

    Each row count gets its share of every stretch of time, and which row follows which
    changes, so no row always pays for its predecessor's leftovers.
    """
    rows = tuple(rows)
    rounds: list[tuple[int, ...]] = []
    rng = np.random.default_rng(seed)

    def order(k: int) -> int:
        while len(rounds) <= k // len(rows):
            rounds.append(tuple(int(g) for g in rng.permutation(rows)))
        return rounds[k // len(rows)][k % len(rows)]
    return order


def time_run(engine, run: Run, policy: ForcedTiers, plan: CalibrationPlan, generator: torch.Generator,
             group: int) -> list[TimedStep]:
    """Admit the run's requests, decode, and return its timed intervals in order."""
    settings = plan.settings
    warmup = max(settings.warmup_steps, 1)  # the first interval starts at a completed step
    timed = settings.window_steps * settings.windows_per_point
    needed = warmup + timed
    vocab = engine.runner.target.config.vocab_size
    stamps: list[tuple[float, int]] = []

    def observe(report) -> None:
        if report.live_requests == run.request_bucket:
            stamps.append((time.perf_counter(), report.target_rows))

    requests = []
    policy.begin_run(warmup)
    with engine.use_policy(policy):
        engine.add_observer(observe)
        try:
            params = SamplingParams(max_tokens=needed * (settings.draft_width + 1) + 1, ignore_eos=True)
            for _ in range(run.request_bucket):
                prompt = torch.randint(0, vocab, (run.prefill_tokens,), generator=generator).tolist()
                requests.append(engine.add_request(prompt, params))
            while len(stamps) < needed + 1:
                engine.check_startup_abort()
                engine.step()
                if all(r.finish_reason is not None for r in requests):
                    raise ConfigError(f"calibration: requests of {run} finished before {needed} steps")
        finally:
            for request in requests:
                if request.finish_reason is None:
                    engine.cancel(request)
            while engine.queue.in_flight:
                engine.step()  # drain launched steps so the next run starts clean
            engine.remove_observer(observe)
    policy.cursor += timed
    return [TimedStep(group, run.request_bucket, rows, run.context_index, run.draft_off, end - start)
            for (start, _), (end, rows) in zip(stamps[warmup - 1 : needed - 1], stamps[warmup:needed])]


def cut_windows(steps: Sequence[TimedStep], window_steps: int, windows_per_point: int) -> list[CostSample]:
    """Each point's first ``window_steps × windows_per_point`` intervals of each run group, as windows.

    A group is a sequential run, or all runs of an interleaved bucket (several runs share
    its rows, and a top-up run may add intervals to rows that came short).
    """
    grouped: dict[tuple[int, int, int, int, bool], list[TimedStep]] = defaultdict(list)
    for s in steps:
        grouped[(s.group, s.request_bucket, s.target_rows, s.context, s.draft_off)].append(s)
    samples = []
    for (_, bucket, rows, context, off), items in grouped.items():
        for w in range(windows_per_point):
            window = items[w * window_steps : (w + 1) * window_steps]
            if len(window) < window_steps:
                raise ConfigError(f"calibration: bucket {bucket} at {rows} rows got {len(items)} timed steps, "
                                  f"fewer than {window_steps * windows_per_point}")
            samples.append(CostSample(bucket, rows, context, sum(s.seconds for s in window), window_steps, off))
    return samples


def probe_runs(plan: CalibrationPlan, run: Run, runs: int, group: int,
               timed_run: Callable[[Run, ForcedTiers, int], list[TimedStep]]) -> list[TimedStep]:
    """Every run of one group; interleaved rows that came short get top-up runs of their own.

    Every interval is labelled with ``group``, so that windows are cut per group.
    """
    settings = plan.settings
    order = shuffled_order(run.rows, settings.token_seed + group)
    policy = ForcedTiers(run.request_bucket, order, draft=not run.draft_off)
    steps: list[TimedStep] = []
    for _ in range(runs):
        steps += timed_run(run, policy, group)
    needed = settings.window_steps * settings.windows_per_point
    for _ in range(len(run.rows)):  # a row comes short only when admission steps shifted the order
        counts = {g: sum(1 for s in steps if s.target_rows == g) for g in run.rows}
        short = tuple(g for g in run.rows if counts[g] < needed)
        if not short:
            break
        policy = ForcedTiers(run.request_bucket, shuffled_order(short, settings.token_seed), draft=not run.draft_off)
        steps += timed_run(attrs.evolve(run, rows=short), policy, group)
    return steps


def run_probes(engine, plan: CalibrationPlan, *, progress: bool = True,
               announce: Callable[[Run], AbstractContextManager[None]] = lambda run: nullcontext(),
               combine: Callable[[list[float]], list[float]] = lambda seconds: seconds) -> list[CostSample]:
    """Probe every point of ``plan``; a tqdm bar counts runs and shows the one being measured.

    The bar is drawn on a terminal only: where stderr is a file or a pipe (a served process's
    log, read one JSON object per line) its carriage-return redraws would run into the log
    records, so one ``calibrating`` event says what is about to be measured instead.

    Each recorded run happens inside ``announce(run)``: rank 0 of a multi-rank service tells the
    other ranks there, so that they time the same intervals; ``combine`` then merges every rank's
    seconds of each interval (in order) before windows are cut. The unrecorded first run is not
    announced (the other ranks replay its steps without timing them).
    """
    settings = plan.settings
    generator = torch.Generator().manual_seed(settings.token_seed)
    groups = plan_runs(plan)
    if groups:
        # one unrecorded run: the first prefill and draft calls of a process are slow
        # (allocator, kernel selection) and would otherwise inflate the first point
        first = groups[0][0]
        warm = ForcedTiers(first.request_bucket, shuffled_order(first.rows, 0), draft=not first.draft_off)
        time_run(engine, first, warm, plan, torch.Generator().manual_seed(settings.token_seed), -1)
    runs = sum(n for _, n in groups)
    on_terminal = sys.stderr.isatty()
    if progress and not on_terminal:
        get_logger("startup").info("calibrating", runs=runs, request_buckets=sorted({r.request_bucket for r, _ in groups}))
    bar = tqdm(total=runs, desc="calibrating", unit="point", disable=not (progress and on_terminal), leave=False)

    def timed_run(run: Run, policy: ForcedTiers, group: int) -> list[TimedStep]:
        bar.set_postfix_str(f"bucket={run.request_bucket} rows={run.describe()} ctx={run.context_index}")
        with announce(run):
            steps = time_run(engine, run, policy, plan, generator, group)
        engine.work.profiling_runs += 1
        bar.update(min(1, bar.total - bar.n))
        return steps

    steps: list[TimedStep] = []
    for group, (run, runs) in enumerate(groups):
        steps += probe_runs(plan, run, runs, group, timed_run)
    bar.close()
    seconds = combine([s.seconds for s in steps])
    steps = [attrs.evolve(s, seconds=x) for s, x in zip(steps, seconds)]
    engine.reset_counters()  # serving statistics start at ready
    return cut_windows(steps, settings.window_steps, settings.windows_per_point)


def probe_point(engine, point: ProbePoint, plan: CalibrationPlan, generator: torch.Generator) -> list[CostSample]:
    """One point on its own (one sequential run): its windows (used by the benchmark scripts)."""
    run = Run(point.request_bucket, (point.target_rows,), point.context_index, point.prefill_tokens, point.draft_off)
    policy = ForcedTiers(point.request_bucket, lambda k: point.target_rows, draft=not point.draft_off)
    steps = time_run(engine, run, policy, plan, generator, 0)
    return cut_windows(steps, plan.settings.window_steps, plan.settings.windows_per_point)


def points_summary(points: Sequence[ProbePoint]) -> dict[str, list[int]]:
    """Rows probed per bucket (for the audit and logs)."""
    out: dict[str, list[int]] = {}
    for p in points:
        if p.draft_off:
            continue  # listed apart (draft_off_summary)
        out.setdefault(str(p.request_bucket), [])
        if p.target_rows not in out[str(p.request_bucket)]:
            out[str(p.request_bucket)].append(p.target_rows)
    return out


def draft_off_summary(points: Sequence[ProbePoint]) -> list[int]:
    """Buckets probed with the draft off (for the audit and logs)."""
    return sorted({p.request_bucket for p in points if p.draft_off})
