"""The startup stages after warmup: calibrate, fit, install, save, audit, ready.

The core holds each stage's implementation (:func:`calibrate`, :func:`fit`,
:func:`install`); the stage hooks are where a plugin plugs in:
``dspark_calibrate`` and ``dspark_fit`` replace the core's stage when a plugin
returns a result, ``dspark_install_table`` implementations run before the
core installs the table. :func:`bring_up` runs the whole sequence for one launch.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from dspark_core.audit import emit_startup_audit, get_logger
from dspark_core.calibration.plan import CalibrationPlan
from dspark_core.calibration.probe import draft_off_summary, points_summary, run_probes
from dspark_core.convert import unstructure
from dspark_core.costs.base import CostSample
from dspark_core.models.attention import invariant_key_tails
from dspark_core.plugins import Hooks
from dspark_core.table import CostTable, fit_table, save_table


@attrs.define
class StartupRuntime:
    """What the startup hooks receive as ``runtime``."""

    engine: Any
    launch: Any
    progress: bool = True

    # The warmup hook receives the engine itself; these mirror its attributes so the
    # same default implementation works for both.
    @property
    def runner(self) -> Any:
        return self.engine.runner

    @property
    def geometry(self) -> Any:
        return self.engine.geometry


def calibrate(runtime: StartupRuntime, plan: CalibrationPlan) -> list[CostSample]:
    return run_probes(runtime.engine, plan, progress=runtime.progress)


def fit(runtime: StartupRuntime, plan: CalibrationPlan, samples: list[CostSample]) -> CostTable:
    runtime.engine.work.fits += 1
    launch = runtime.launch
    return fit_table(plan.settings, samples, launch.hooks.cost_model, launch.fingerprint)


def install(runtime: StartupRuntime, table: CostTable) -> None:
    runtime.engine.install_table(table)


def calibrate_stage(hooks: Hooks, runtime: StartupRuntime, plan: CalibrationPlan) -> list[CostSample]:
    """The calibration stage: a plugin's samples, else the core's probes."""
    samples = hooks.calibrate(runtime, plan)
    return calibrate(runtime, plan) if samples is None else list(samples)


def fit_stage(hooks: Hooks, runtime: StartupRuntime, plan: CalibrationPlan, samples: list[CostSample]) -> CostTable:
    """The fitting stage: a plugin's table, else the core's fit."""
    table = hooks.fit(runtime, plan, samples)
    return fit(runtime, plan, samples) if table is None else table


def install_stage(hooks: Hooks, runtime: StartupRuntime, table: CostTable) -> None:
    """The install stage: every plugin's ``dspark_install_table`` (they may check the table), then the core's."""
    hooks.install_table(runtime, table)
    install(runtime, table)


def geometry_record(geometry) -> dict[str, Any]:
    """The captured geometry as the audit shows it."""
    return {"draft_width": geometry.draft_width, "request_buckets": list(geometry.request_buckets),
            "target_rows": {str(b): [rows[0], rows[-1], len(rows)] for b, rows in geometry.tiers}}


def bring_up(engine, launch, *, progress: bool = True) -> CostTable | None:
    """Warm up, then calibrate+fit (or reuse), install, save and audit; marks the engine ready."""
    log = get_logger("startup")
    hooks = launch.hooks
    started = time.perf_counter()
    if not launch.config.disable_graph_warmup:
        engine.warmup()
    warm_seconds = time.perf_counter() - started
    engine.check_startup_abort()
    table = None
    if launch.config.adaptive:
        runtime = StartupRuntime(engine, launch, progress)
        if launch.saved_table is not None:
            table = launch.saved_table
            source = "saved table"
        else:
            samples = calibrate_stage(hooks, runtime, launch.plan)
            table = fit_stage(hooks, runtime, launch.plan, samples)
            source = launch.plan.source
        install_stage(hooks, runtime, table)
        if launch.config.adaptive_dspark_cost_table_output and launch.saved_table is None:
            save_table(table, launch.config.adaptive_dspark_cost_table_output)
        _audit(launch, engine, table, source)
    engine.mark_ready()
    log.info("engine ready", warmup_seconds=round(warm_seconds, 2),
             startup_seconds=round(time.perf_counter() - started, 2), work=engine.work_counters())
    return table


def _audit(launch, engine, table: CostTable, source: str) -> None:
    invariant = bool(getattr(engine.runner.target, "batch_invariant", False))
    extra: dict[str, Any] = {"cost_model": table.model, "graph_backend": engine.runner.graphs.name
                             if engine.runner.graphs is not None else "disabled",
                             "dtype": launch.dtype, "draft_dtype": launch.draft_dtype,
                             # verify rows carry the target-only rows' logits bit for bit (docs/architecture.md)
                             "batch_invariant": invariant,
                             # the short last key blocks invariant attention may read here (null: not invariant)
                             "attention_key_tails": list(invariant_key_tails()) if invariant else None,
                             # greedy tokens from a bfloat16 LM head plus exact candidate logits (models/greedy_head.py)
                             "greedy_head": bool(getattr(engine.runner.target, "greedy_head_active", False)),
                             # host intra-op threads the steps were priced at, as the table records them
                             # (null: not priced by them)
                             "cpu_threads": None if launch.fingerprint is None
                             else launch.fingerprint.execution.cpu_threads,
                             "max_model_len": engine.max_model_len,
                             # KV spans the cache-reading keys were also captured for ([]: the whole cache only)
                             "kv_spans": list(engine.runner.kv_spans),
                             # []: the draft proposes alone; else the key lengths copy proposals try
                             "copy_orders": list(engine.runner.copy_orders),
                             # request bucket -> tokens the draft proposes there where fewer than K ({}: K everywhere)
                             "draft_depths": {str(b): d for b, d in sorted(engine.runner.draft_depths.items())}}
    if source == "saved table":
        extra["table_path"] = launch.config.adaptive_dspark_cost_table
        extra["saved_settings"] = unstructure(table.settings) if table.settings is not None else None
        extra["coverage"] = [{"context": None if f.context is None else unstructure(f.context),
                              "coverage": unstructure(f.coverage)} for f in table.fits]
        if launch.table_note:
            extra["note"] = launch.table_note
        settings = extra["saved_settings"] or {"model": table.model, "draft_width": table.draft_width}
    else:
        settings = unstructure(launch.plan.settings)
        if settings.get("target_graph_rows") is None:
            settings["target_graph_rows"] = points_summary(launch.plan.points)
        extra["probe_points"] = len(launch.plan.points)
        extra["draft_off_buckets"] = draft_off_summary(launch.plan.points)
    emit_startup_audit(source, settings, geometry_record(engine.geometry), **extra)
