"""Probing: drive the real engine pipeline on random tokens, one probe point at a time.

For each point, ``Bcap`` requests of ``prefill_tokens`` random tokens are
admitted together and decoded with the point's target rows forced. Time is
read only when a step's results are processed on the host (the pipeline's own
result readiness), never with extra timing events or device copies; a window
is ``window_steps`` consecutive completed decode intervals. Samples stay in
memory until the fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from attrs import frozen
from tqdm import tqdm

from dspark_core.calibration.plan import CalibrationPlan, ProbePoint
from dspark_core.costs.base import CostSample
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.policy import StepPlan, TierChoice, TierContext, allocate_split


@frozen
class ForcedTier:
    """A budget policy pinned to one captured tier of one bucket, drafting or not (calibration only).

    Steps of another bucket happen while the point's requests are still being admitted (the
    scheduler's prefill budget can hold fewer prompts than the bucket, e.g. 64 of 256 tokens
    against 8 192); they are never timed, so they run as plain drafted steps of their own bucket.
    """

    request_bucket: int
    rows: int
    draft: bool = True
    name: str = "forced-tier"
    uses_draft: bool = True
    tier_lag: int = 0

    def plan(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> StepPlan:
        return StepPlan(draft=self.draft or ctx.request_bucket != self.request_bucket)

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        if ctx.request_bucket != self.request_bucket:
            return TierChoice(min(ctx.tiers))
        if self.rows not in ctx.tiers:
            raise ConfigError(f"calibration: {self.rows} target rows are not captured for bucket {ctx.request_bucket}")
        return TierChoice(self.rows)

    split = staticmethod(allocate_split)


def probe_point(engine, point: ProbePoint, plan: CalibrationPlan, generator: torch.Generator) -> list[CostSample]:
    """Run one point and return its windows."""
    settings = plan.settings
    warmup = max(settings.warmup_steps, 1)  # the first interval starts at a completed step
    needed = warmup + settings.window_steps * settings.windows_per_point
    vocab = engine.runner.target.config.vocab_size
    stamps: list[float] = []

    def observe(report) -> None:
        if report.live_requests == point.request_bucket:
            stamps.append(time.perf_counter())

    requests = []
    with engine.use_policy(ForcedTier(point.request_bucket, point.target_rows, not point.draft_off)):
        engine.add_observer(observe)
        try:
            params = SamplingParams(max_tokens=needed * (settings.draft_width + 1) + 1, ignore_eos=True)
            for _ in range(point.request_bucket):
                prompt = torch.randint(0, vocab, (point.prefill_tokens,), generator=generator).tolist()
                requests.append(engine.add_request(prompt, params))
            while len(stamps) < needed + 1:
                engine.check_startup_abort()
                engine.step()
                if all(r.finish_reason is not None for r in requests):
                    raise ConfigError(f"calibration: requests of point {point} finished before {needed} steps")
        finally:
            for request in requests:
                if request.finish_reason is None:
                    engine.cancel(request)
            while engine.queue.in_flight:
                engine.step()  # drain launched steps so the next point starts clean
            engine.remove_observer(observe)
    samples = []
    for w in range(settings.windows_per_point):
        start = stamps[warmup - 1 + w * settings.window_steps]
        end = stamps[warmup - 1 + (w + 1) * settings.window_steps]
        samples.append(CostSample(point.request_bucket, point.target_rows, point.context_index, end - start,
                                  settings.window_steps, point.draft_off))
    return samples


def run_probes(engine, plan: CalibrationPlan, *, progress: bool = True,
               announce: Callable[[ProbePoint], AbstractContextManager[None]] = lambda point: nullcontext()
               ) -> list[CostSample]:
    """Probe every point of ``plan`` in order; a tqdm bar shows the point being measured.

    Each recorded point runs inside ``announce(point)``: rank 0 of a multi-rank service
    tells the other ranks there, so that they time the same windows. The unrecorded first
    pass is not announced (they replay its steps without timing them).
    """
    generator = torch.Generator().manual_seed(plan.settings.token_seed)
    if plan.points:
        # one unrecorded pass: the first prefill and draft calls of a process are slow
        # (allocator, kernel selection) and would otherwise inflate the first point
        probe_point(engine, plan.points[0], plan, torch.Generator().manual_seed(plan.settings.token_seed))
    samples: list[CostSample] = []
    bar = tqdm(plan.points, desc="calibrating", unit="point", disable=not progress, leave=False)
    for point in bar:
        rows = "draft-off" if point.draft_off else point.target_rows
        bar.set_postfix_str(f"bucket={point.request_bucket} rows={rows} ctx={point.context_index}")
        with announce(point):
            samples += probe_point(engine, point, plan, generator)
        engine.work.profiling_runs += 1
    engine.reset_counters()  # serving statistics start at ready
    return samples


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
