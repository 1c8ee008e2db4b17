"""Value objects around the engine: its configuration, counters and per-step reports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import define, field, frozen

from dspark_core.convert import int_tuple


def _options(values: Mapping[str, Any]) -> dict[str, Any]:
    return dict(values)  # a typed converter (see dspark_core.convert.int_tuple)


@frozen
class EngineConfig:
    """Engine-level settings (the serve flags map onto these)."""

    draft_width: int = 7
    policy: str = "adaptive"
    policy_options: Mapping[str, Any] = field(factory=dict, converter=_options)
    request_buckets: tuple[int, ...] = field(default=(1, 2, 4, 8, 16), converter=int_tuple)
    max_model_len: int = 2048
    max_prefill_tokens: int = 8192
    schedule_overlap: bool = False  # launch step t+1 before step t's results are back
    copy_proposals: str = "auto"  # auto (as the draft's config says), on or off (dspark_core.engine.copies)
    # KV spans the cache-reading keys are also prepared for: auto, off or a list (geometry.kv_spans)
    captured_kv_spans: str = "auto"
    # (request bucket, tokens the draft proposes there) where fewer than K; other buckets propose K
    draft_depths: tuple[tuple[int, int], ...] = ()


@frozen
class StepReport:
    """What observers (metrics, benchmark) learn about each processed decode step."""

    live_requests: int
    request_bucket: int
    target_rows: int
    verify_lengths: tuple[int, ...]
    accepted: tuple[int, ...]
    fallback: bool
    predicted_tokens: float  # the policy's forecast (NaN when it made none)
    committed_tokens: int  # tokens actually committed (including ones cut by stop conditions)
    tiers: tuple[int, ...] = ()  # captured tiers of the bucket
    tier_costs: Any = None  # their calibrated seconds (None: no profile) — for model-based accounting
    draft_off: bool = False  # the step ran no draft and verified nothing (one token per request)
    draft_off_cost: float | None = None  # calibrated seconds of a draft-off step of this bucket
    forecast_scale: float = 1.0  # the scale the policy applied to the confidences' expectation
    copy_only: bool = False  # the step ran no draft but verified copy proposals (a copy step)
    # measured wall seconds of the step's device work, result copy included (None: not timed). With
    # schedule overlap the host plans the next step meanwhile, so this is what the step really cost
    # while serving, contention included; a prefill is a job of its own and is not in it.
    step_seconds: float | None = None

    @property
    def drafted(self) -> bool:
        """Whether the draft proposed this step's block: False for a draft-off step and a copy step."""
        return not (self.draft_off or self.copy_only)


@define
class StartupWork:
    """Startup-only work; none of it may happen after the engine is ready."""

    fits: int = 0
    profiling_runs: int = 0


@frozen
class EngineCounters:
    """Step counters since start (read by tests, metrics and the benchmark)."""

    steps: int
    fallback_steps: int
    committed_tokens: int
    draft_off_steps: int = 0
    copy_steps: int = 0  # draft-off steps that verified copy proposals
