"""The effective calibration configuration and every rule it must satisfy before any work.

Sources: the built-in defaults, or a JSON file (``--adaptive_dspark_calibration``)
whose omitted fields fall back to the defaults. The draft width always comes
from the launch; a file may repeat it but must agree. The result is a
:class:`CalibrationPlan`: resolved settings plus the probe points to run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs
from attrs import field, frozen
from cattrs.gen import make_dict_structure_fn, override

from dspark_core.convert import converter, load_json_file
from dspark_core.costs.base import check_grid
from dspark_core.errors import ConfigError
from dspark_core.fit_settings import CalibrationSettings, ContextInterval, TargetRows, normalize_rows, structure_rows
from dspark_core.geometry import Geometry, full_width_rows, kv_reserve

#: The cost model a calibration without a ``model`` field fits. Only a default *name*,
#: like the ``--budget_policy`` default: it is resolved through the ``dspark_cost_model``
#: hook like any other (a plugin of yours may provide "additive", or a calibration
#: file may name another model), so the core imports no cost model for it.
DEFAULT_MODEL = "additive"
DEFAULT_PREFILL = 2048
DEFAULT_MAX_KV = 4096
DEFAULT_STEPS = {"warmup_steps": 8, "window_steps": 32, "windows_per_point": 3, "token_seed": 1}
#: A bucket's rows take turns step by step, so slow drift of a shared machine cannot pass for a slope.
DEFAULT_PROBE_ORDER = "interleaved"


@frozen
class CalibrationFile:
    """``--adaptive_dspark_calibration`` as written: every field optional."""

    model: str | None = None
    draft_width: int | None = None
    request_buckets: tuple[int, ...] | None = None
    target_graph_rows: TargetRows | None = field(default=None, converter=normalize_rows)
    contexts: tuple[ContextInterval, ...] | None = None
    warmup_steps: int | None = None
    window_steps: int | None = None
    windows_per_point: int | None = None
    token_seed: int | None = None
    draft_off: bool | None = None
    probe_order: str | None = None


@frozen
class ProbePoint:
    """One (request bucket, target rows) point sampled in one context interval.

    ``draft_off`` points run no draft and verify one row per request
    (``target_rows`` equals the bucket).
    """

    request_bucket: int
    target_rows: int
    context_index: int
    prefill_tokens: int
    draft_off: bool = False


@frozen
class CalibrationPlan:
    """Resolved settings, where they came from, and the points calibration will probe."""

    settings: CalibrationSettings
    source: str  # "defaults" or "file"
    points: tuple[ProbePoint, ...]


converter.register_structure_hook(
    CalibrationFile,
    make_dict_structure_fn(CalibrationFile, converter, target_graph_rows=override(struct_hook=structure_rows)),
)


def read_calibration_file(path: str) -> CalibrationFile:
    """Strictly parse a calibration file; errors name the JSON path (``$.contexts[0].x``)."""
    try:
        return load_json_file(path, CalibrationFile)
    except ConfigError as exc:
        raise ConfigError(f"--adaptive_dspark_calibration: {exc}") from None


def worst_case_progress(settings: CalibrationSettings) -> int:
    """KV positions one probe point may advance: every step commits up to K+1 tokens,
    plus the two launched steps in flight beyond the last processed one."""
    steps = max(settings.warmup_steps, 1) + settings.window_steps * settings.windows_per_point
    return steps * (settings.draft_width + 1) + kv_reserve(settings.draft_width) + 1


def _default_contexts(kv_limit: int, progress: int) -> tuple[ContextInterval, ...]:
    max_kv = min(DEFAULT_MAX_KV, kv_limit)
    prefill = min(DEFAULT_PREFILL, max_kv - progress)
    if prefill < 1:
        raise ConfigError(
            f"the default calibration does not fit this launch: its sampling advances up to {progress} KV "
            f"positions per point but the context limit is {kv_limit}; pass --adaptive_dspark_calibration "
            f"with fewer steps (warmup_steps, window_steps, windows_per_point) or a smaller explicit context"
        )
    return (ContextInterval(prefill, 1, max_kv),)


def _rows_for(settings: CalibrationSettings, bucket: int, geometry: Geometry) -> tuple[int, ...]:
    rows = settings.target_graph_rows
    if rows is None:
        return geometry.rows_for(bucket)
    per_bucket = settings.rows_by_bucket()
    if per_bucket is not None:
        return per_bucket.get(bucket, ())
    shared = cast(tuple[int, ...], rows)  # not per bucket: one row list for every bucket
    return tuple(g for g in shared if bucket <= g <= full_width_rows(bucket, settings.draft_width))


def _check_rows_reach_buckets(settings: CalibrationSettings) -> None:
    """Refuse ``target_graph_rows`` that would leave a request bucket unprobed, or name rows no bucket
    runs: either would otherwise be dropped without a word (a bucket without drafted points falls
    back to full width on every step)."""
    rows = settings.target_graph_rows
    if rows is None:
        return
    width = settings.draft_width
    per_bucket = settings.rows_by_bucket()
    if per_bucket is not None:
        missing = [b for b in settings.request_buckets if not per_bucket.get(b)]
        if missing:
            wanted = ", ".join(f"{b} (full width {full_width_rows(b, width)})" for b in missing)
            raise ConfigError(f"target_graph_rows gives no rows for request buckets {wanted}: list each bucket "
                              f"of request_buckets with its rows, full width included, or leave target_graph_rows out")
        return
    shared = cast(tuple[int, ...], rows)
    unused = [g for g in shared if not any(b <= g <= full_width_rows(b, width) for b in settings.request_buckets)]
    if unused:
        spans = ", ".join(f"{b}..{full_width_rows(b, width)}" for b in settings.request_buckets)
        raise ConfigError(f"target_graph_rows {unused} fit no request bucket's tiers at K={width} (bucket b runs "
                          f"b..(K+1)*b rows: {spans})")


def _check(settings: CalibrationSettings, geometry: Geometry, kv_limit: int,
           grid_check: Callable[[list[tuple[int, int]], int], None] | None) -> tuple[ProbePoint, ...]:
    captured = set(geometry.request_buckets)
    missing = [b for b in settings.request_buckets if b not in captured]
    if missing:
        raise ConfigError(f"request_buckets {missing} are not captured request buckets "
                          f"(captured: {sorted(captured)})")
    _check_rows_reach_buckets(settings)
    points: list[tuple[int, int]] = []
    for bucket in settings.request_buckets:
        rows = _rows_for(settings, bucket, geometry)
        uncaptured = [g for g in rows if g not in geometry.rows_for(bucket)]
        if uncaptured:
            raise ConfigError(f"target_graph_rows {uncaptured} for request bucket {bucket} are not captured tiers "
                              f"(captured: {geometry.rows_for(bucket)[0]}..{geometry.rows_for(bucket)[-1]})")
        points += [(bucket, g) for g in rows]
    check_grid(points, settings.draft_width, settings.model)  # full-width coverage per bucket
    if grid_check is not None:
        grid_check(points, settings.draft_width)  # model-specific (additive: connected through shared G)
    progress = worst_case_progress(settings)
    plan = []
    for index, ctx in enumerate(settings.contexts):
        where = f"contexts[{index}] {ctx.describe()}"
        if ctx.max_kv_length > kv_limit:
            raise ConfigError(f"{where}: max_kv_length exceeds the context limit {kv_limit} (model and KV cache)")
        if ctx.prefill_tokens + 1 < ctx.min_kv_length:
            raise ConfigError(f"{where}: prefill_tokens + 1 must reach min_kv_length so samples lie in the interval")
        if ctx.prefill_tokens < 1:
            raise ConfigError(f"{where}: prefill_tokens must be >= 1 (calibration prefills random tokens)")
        if ctx.prefill_tokens + progress > ctx.max_kv_length:
            raise ConfigError(f"{where}: prefill {ctx.prefill_tokens} + worst-case sampling progress {progress} "
                              f"exceeds max_kv_length {ctx.max_kv_length}; shorten the prefill or the steps")
        for bucket in settings.request_buckets:
            bucket_points = [ProbePoint(b, g, index, ctx.prefill_tokens) for b, g in points if b == bucket]
            # A draft-off step runs the bucket's smallest tier, so it needs that tier captured. The
            # policy compares exactly the bucket's draft-off cost with its drafting costs, so the
            # draft-off point is probed twice, just before and just after the drafting points: the
            # drafting costs are pooled over several points by the fit, the draft-off one is a
            # single parameter, and bracketing gives it twice the windows and cancels slow drift
            # of a shared machine between the two.
            if settings.draft_off and bucket in geometry.rows_for(bucket):
                off = ProbePoint(bucket, bucket, index, ctx.prefill_tokens, draft_off=True)
                bucket_points = [off, *bucket_points, off]
            plan += bucket_points
    return tuple(plan)


def resolve_plan(draft_width: int, geometry: Geometry, kv_limit: int, file: CalibrationFile | None = None,
                 grid_check: Callable[[str], Any] | None = None) -> CalibrationPlan:
    """Merge defaults and ``file``, then validate everything against the captured geometry.

    ``kv_limit`` is the smaller of the model's context limit and the KV cache
    length. ``grid_check(model_name)`` returns the cost model's own grid check
    (or None). Raises ConfigError naming the rule and the numbers.
    """
    given = {} if file is None else {
        a.name: getattr(file, a.name) for a in attrs.fields(CalibrationFile) if getattr(file, a.name) is not None}
    if "draft_width" in given and given["draft_width"] != draft_width:
        raise ConfigError(f"calibration draft_width {given['draft_width']} does not match "
                          f"num_speculative_tokens={draft_width}")
    values: dict[str, Any] = {"model": DEFAULT_MODEL, **DEFAULT_STEPS, "draft_off": True, "probe_order": DEFAULT_PROBE_ORDER,
              "request_buckets": geometry.request_buckets,
              "contexts": (ContextInterval(1, 1, 1),)}  # placeholder until the progress is known
    values.update(given)
    values["draft_width"] = draft_width
    provisional = CalibrationSettings(**values)
    if "contexts" not in given:
        values["contexts"] = _default_contexts(kv_limit, worst_case_progress(provisional))
    settings = CalibrationSettings(**values)
    model_check = grid_check(settings.model) if grid_check is not None else None
    points = _check(settings, geometry, kv_limit, model_check)
    return CalibrationPlan(settings, "file" if file is not None else "defaults", points)
