"""From serve flags to a ready engine: validate, load, warm up, calibrate or reuse, install.

Order matters and follows the spec: every rule is checked before any work
(flags, calibration file, output path, saved table), then graphs are warmed,
then the cost table is calibrated and fitted (or loaded), installed, and only
then is the engine ready. A saved table skips calibration and fitting, never
warmup.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import define, field

from dspark_core.audit import get_logger
from dspark_core.calibration.plan import CalibrationFile, CalibrationPlan, read_calibration_file, resolve_plan
from dspark_core.config import ServeConfig
from dspark_core.costs.fingerprint import Fingerprint
from dspark_core.device import DeviceSpec, resolve_draft_dtype, resolve_dtype
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.errors import ConfigError
from dspark_core.geometry import Geometry
from dspark_core.plugins import Hooks, load_hooks
from dspark_core.resolve import captured_geometry, draft_depths_for, fingerprint_for, graph_backend_for, pick_device
from dspark_core.table import CostTable, check_compatible, check_output_path, load_table
from dspark_core.validate import check_config


@define
class Launch:
    """Everything resolved from the flags before the first tensor is allocated."""

    config: ServeConfig
    hooks: Hooks
    device: DeviceSpec
    dtype: str
    draft_dtype: str
    geometry: Geometry
    policy: str
    policy_options: dict[str, Any]
    calibration_file: CalibrationFile | None = None
    saved_table: CostTable | None = None
    target_path: Path | None = None
    draft_path: Path | None = None
    fingerprint: Fingerprint | None = None
    plan: CalibrationPlan | None = None
    table_note: str | None = None
    model_family: Any = None  # the target's model-family plugin object, set by build_engine
    # request bucket -> tokens the draft proposes there, where fewer than K (--draft_depths)
    draft_depths: dict[int, int] = field(factory=dict)


def pick_policy(config: ServeConfig) -> tuple[str, dict[str, Any]]:
    try:
        options = json.loads(config.budget_policy_options)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"budget_policy_options: not valid JSON ({exc.msg})") from None
    if not isinstance(options, dict):
        raise ConfigError("budget_policy_options: must be a JSON object")
    if config.budget_policy != "auto":
        return config.budget_policy, options
    if not config.speculative:
        return "none", options
    return ("adaptive" if config.adaptive else "fixed"), options


def resolve_launch(config: ServeConfig) -> Launch:
    """Check every flag-level rule and read every input file; allocates nothing."""
    check_config(config)
    hooks = load_hooks(config.plugin)
    device = pick_device(hooks, config.device)
    policy, options = pick_policy(config)
    hooks.budget_policy(policy, options)  # a misspelt policy or a bad option fails now, not after the models load
    dtype = resolve_dtype(config.dtype, device)
    launch = Launch(config, hooks, device, dtype, resolve_draft_dtype(config.draft_dtype, device, dtype),
                    captured_geometry(config), policy, options)
    launch.draft_depths = draft_depths_for(config, device, launch.geometry)
    prepare = getattr(device, "prepare_launch", None)  # device-specific flags (threads, environment report)
    if prepare is not None:
        prepare(config)
    if config.enable_graph:
        hooks.graph_backend(graph_backend_for(config, device), device)  # fails now, not after loading, when it cannot run here
    if config.batch_invariant == "on" and device.name != "cpu":
        raise ConfigError(f"--batch_invariant=on: batch-invariant forwards exist on the cpu device only, not {device.name}")
    if config.adaptive_dspark_cost_table_output:
        check_output_path(config.adaptive_dspark_cost_table_output)
    if config.adaptive_dspark_calibration:
        from dspark_core.configs import DEMO, fit_demo_to_buckets, resolve_calibration

        path = resolve_calibration(config.adaptive_dspark_calibration, config.num_speculative_tokens, dtype)
        launch.calibration_file = read_calibration_file(path)
        if config.adaptive_dspark_calibration == DEMO:
            launch.calibration_file = fit_demo_to_buckets(launch.calibration_file, launch.geometry.request_buckets)
    if config.adaptive_dspark_cost_table:
        launch.saved_table = load_table(config.adaptive_dspark_cost_table, hooks.cost_model)
    return launch


def _resolve_paths(launch: Launch) -> None:
    from dspark_core.models.fetch import resolve_model_path

    config = launch.config
    assert config.model is not None  # check_config requires --model
    launch.target_path = resolve_model_path(config.model)
    if config.speculative and launch.policy != "none":
        assert config.draft_model is not None  # check_config requires it with speculation on
        if config.draft_model == "default":
            from dspark_core.models.drafts import default_draft_path

            launch.draft_path = default_draft_path(config.model)
        else:
            launch.draft_path = Path(config.draft_model)


def graph_backend_name(launch: Launch) -> str:
    """The launch's graph backend (``disabled`` without ``--enable_graph``)."""
    return graph_backend_for(launch.config, launch.device)


def fingerprint_launch(launch: Launch) -> Fingerprint:
    """The launch's fingerprint, from what it resolved (device, dtype, geometry, checkpoint paths)."""
    return fingerprint_for(launch.config, launch.device, geometry=launch.geometry, dtype=launch.dtype,
                           draft_dtype=launch.draft_dtype, target_path=launch.target_path, draft_path=launch.draft_path)


def apply_batch_invariance(target: Any, setting: str) -> None:
    """Apply ``--batch_invariant`` to a loaded target, before its cache is allocated.

    ``auto`` keeps the target's own default. ``on`` needs a target with batch-invariant forwards
    (``set_batch_invariant``; :func:`resolve_launch` has already refused devices other than the
    CPU); ``off`` turns them off where there are any and is a no-op elsewhere."""
    if setting == "auto":
        return
    setter = getattr(target, "set_batch_invariant", None)
    if setter is None:
        if setting == "on":
            raise ConfigError(f"--batch_invariant=on: the {type(target).__name__} target has no batch-invariant forwards")
        return
    setter(setting == "on")


def build_engine(launch: Launch) -> Engine:
    """Load the models and construct the engine; then check table and plan against the real model."""
    from dspark_core.models.loading import target_family
    from dspark_core.models.speculators_io import load_draft

    config = launch.config
    _resolve_paths(launch)
    dtype = getattr(torch, launch.dtype)
    assert launch.target_path is not None  # set by _resolve_paths
    launch.model_family = target_family(launch.target_path, launch.hooks)
    target = launch.model_family.load_target(launch.target_path, device=launch.device.torch_device, dtype=dtype)
    apply_batch_invariance(target, config.batch_invariant)
    draft = None
    if launch.draft_path is not None:
        draft = load_draft(launch.draft_path, device=launch.device.torch_device, dtype=getattr(torch, launch.draft_dtype))
        if config.adaptive and draft.confidence_head is None:
            raise ConfigError(f"draft_model {launch.draft_path}: adaptive DSpark needs a draft with a confidence head")
    graphs = _graphs(launch)
    engine_config = EngineConfig(
        draft_width=max(launch.geometry.draft_width, 1), policy=launch.policy, policy_options=launch.policy_options,
        request_buckets=launch.geometry.request_buckets, max_model_len=config.max_model_len,
        schedule_overlap=config.enable_schedule_overlap and config.enable_task_pipeline,
        copy_proposals=config.copy_proposals, captured_kv_spans=config.captured_kv_spans,
        draft_depths=tuple(sorted(launch.draft_depths.items())),
    )
    geometry = launch.geometry if launch.geometry.draft_width else None
    engine = Engine(target, draft, engine_config, hooks=launch.hooks, geometry=geometry, graphs=graphs)
    if engine.max_model_len < config.max_model_len:
        # the cap is the spec's rule; say so, or a user reading their own flag expects longer prompts to fit
        get_logger("startup").warning(
            "max_model_len capped at the model's context limit", requested=config.max_model_len,
            model_context=target.config.max_position, max_model_len=engine.max_model_len)
    if config.adaptive:
        launch.fingerprint = fingerprint_launch(launch)
        _check_table_or_plan(launch, engine)
    return engine


def _graphs(launch: Launch) -> Any:
    """A new graph backend of the launch's kind (None without ``--enable_graph``)."""
    if not launch.config.enable_graph:
        return None
    return launch.hooks.graph_backend(graph_backend_name(launch), launch.device)


def sibling_engine(engine: Engine, launch: Launch, *, with_draft: bool, overlap: bool) -> Engine:
    """Another ready engine of ``launch`` beside ``engine``: the same target weights, hooks, geometry
    and installed cost table, but its own KV cache, graph buffers and (``with_draft``) its own draft
    instance, since a draft keeps the context cache of the engine it serves. Used to run policies side
    by side in turns (``dspark-core bench --interleave``); warmed before it is returned."""
    from dspark_core.models.speculators_io import load_draft

    draft = None
    if with_draft and launch.draft_path is not None:
        draft = load_draft(launch.draft_path, device=launch.device.torch_device, dtype=getattr(torch, launch.draft_dtype))
    config = engine.config if draft is not None else attrs.evolve(engine.config, policy="none", policy_options={})
    sibling = Engine(engine.runner.target, draft, attrs.evolve(config, schedule_overlap=overlap), hooks=engine.hooks,
                     geometry=engine.geometry, graphs=_graphs(launch))
    if not launch.config.disable_graph_warmup:
        sibling.warmup()
    sibling.install_table(engine.table)
    sibling.mark_ready()
    return sibling


def _check_table_or_plan(launch: Launch, engine: Engine) -> None:
    width = launch.config.num_speculative_tokens
    if launch.saved_table is not None:
        launch.table_note = check_compatible(launch.saved_table, launch.fingerprint, width)
        return
    kv_limit = engine.max_model_len
    grid_check: Callable[[str], Any] = lambda name: getattr(launch.hooks.cost_model(name), "check_grid", None)  # noqa: E731
    launch.plan = resolve_plan(width, launch.geometry, kv_limit, launch.calibration_file, grid_check)
