"""Every hook dspark-core calls, grouped by stage in the order they run.

A plugin is any module or object with functions named like these specs and
decorated with :data:`hookimpl`. Default plugins (``dspark_plugins.*``) are
registered through the ``dspark_core`` entry-point group exactly like a third
party's, so anything they do a user plugin can do too.

Result rules
------------
* ``firstresult`` hooks stop at the first implementation that returns
  something other than ``None``. Selection hooks are ``firstresult``: an
  implementation returns ``None`` when the requested name is not its own.
* The other hooks call every implementation; their return values are
  collected in a list (most recently registered plugin first).

Stage hooks (startup and step) have no default plugin: the core implements
every stage and runs it itself; a plugin implementing a stage hook replaces
that stage (``firstresult`` stages: the core's runs when every plugin returns
``None``) or adds to it (the others). See docs/architecture.md, "Where the
implementation lives".

Nothing outside :mod:`dspark_core.plugins` calls ``pm.hook`` directly; the
rest of the code goes through :class:`dspark_core.plugins.Hooks`, which
checks these rules and turns a missing selection into a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # only for annotations; keeps this module import-light (and below every other layer)
    from dspark_core.calibration.install import StartupRuntime
    from dspark_core.calibration.plan import CalibrationPlan
    from dspark_core.components import Component
    from dspark_core.costs.base import CostModel, CostSample
    from dspark_core.device import DeviceSpec
    from dspark_core.engine.engine import Engine
    from dspark_core.engine.step import Budget, DecodeStep, Proposal, Verification
    from dspark_core.graphs import GraphBackend
    from dspark_core.models.base import ModelFamily
    from dspark_core.policy import BudgetPolicy
    from dspark_core.table import CostTable

PROJECT = "dspark_core"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------


@hookspec
def dspark_components() -> Sequence[Component]:
    """Declare the named components this plugin provides.

    Called by ``dspark-core plugins`` and when a selection fails, so the error
    can list what is available. Return a sequence of
    :class:`dspark_core.components.Component` (kind, name, one-line summary).
    Must be cheap and side-effect free: it may run before any device exists.
    """


# --------------------------------------------------------------------------
# Selection hooks (firstresult): return the component for ``name`` or None.
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def dspark_device(name: str) -> DeviceSpec | None:
    """Return the device object for ``name`` ("cpu", "cuda", "npu", ...).

    Return ``None`` when ``name`` is not provided by this plugin. When the name
    is yours but the hardware or its runtime library is missing, raise
    :class:`dspark_core.errors.ConfigError` saying what is missing; never
    return ``None`` in that case (the user would get "unknown device").
    Importing an optional runtime (torch_npu, ...) must happen here, lazily,
    never at plugin import time.
    """


@hookspec(firstresult=True)
def dspark_graph_backend(name: str, device: DeviceSpec) -> GraphBackend | None:
    """Return the graph backend ``name`` ("static", "cudagraph", "aclgraph").

    ``device`` is the object returned by :func:`dspark_device`. Return
    ``None`` for names that are not yours; raise ``ConfigError`` when the name
    is yours but cannot run on ``device``. A backend captures or warms one
    executable per binding key (K, request bucket, target rows, dtype, device,
    KV span) during warmup and must never capture after the engine reports ready.
    A backend whose ``records`` is true (device graphs) runs each key inside
    ``graphs.static_shapes(key.kv_span)``, as :class:`~dspark_core.graphs.CapturedGraphBackend`
    does, so that the models read exactly the key's KV span.
    """


@hookspec(firstresult=True)
def dspark_cost_model(name: str) -> CostModel | None:
    """Return the cost-model object for ``name`` ("additive", "sps", ...).

    The object fits full-step costs from the calibration samples of one
    context interval (the table keeps one fit per interval, so the KV length
    picks the fit), and each fit predicts the seconds of a (request bucket,
    target rows) step, reports its coverage and (de)serialises its parameters
    for the cost-table bundle. A fit that also prices a draft-off step
    (``predict_draft_off_seconds``) lets ``adaptive`` leave the draft off where
    it does not pay; without it there is no draft-off price. See
    :class:`dspark_core.costs.base.CostModel` and ``FittedCost``. Return
    ``None`` for names that are not yours.
    """


@hookspec(firstresult=True)
def dspark_budget_policy(name: str, options: Mapping[str, Any]) -> BudgetPolicy | None:
    """Return a budget policy instance for ``name`` ("adaptive", "fixed", ...).

    ``options`` holds policy settings from the configuration (for example
    ``k`` for the fixed policy). A policy only decides how many drafted tokens
    each request verifies; it must never influence which tokens are
    committed, so outputs are identical for every policy. Return ``None`` for
    names that are not yours.
    """


@hookspec(firstresult=True)
def dspark_model_family(architecture: str) -> ModelFamily | None:
    """Return the model family handling checkpoint ``architecture``.

    ``architecture`` is the lower-case architecture string of the checkpoint
    (GGUF ``general.architecture`` or the HF ``model_type``: "llama",
    "qwen2", "glm_moe_dsa", ...). Return ``None`` for unsupported ones.
    """


# --------------------------------------------------------------------------
# Startup stages, in order: warmup -> calibration -> fitting -> table install.
# --------------------------------------------------------------------------


@hookspec
def dspark_warmup(runtime: Engine) -> None:
    """Prepare what a plugin needs before calibration or serving.

    Every implementation runs, before the core captures or warms every binding
    key that calibration or serving may use. Runs also when a saved cost table
    is reused: a table never replaces warmup.
    """


@hookspec(firstresult=True)
def dspark_calibrate(runtime: StartupRuntime, plan: CalibrationPlan) -> Sequence[CostSample] | None:
    """Drive the real asynchronous pipeline over ``plan`` and return samples.

    Returns the in-memory completion windows (one sample per window) or
    ``None`` to leave calibration to another plugin or the core's probes. Must not write files and
    must not add timing events or device-to-host copies to the step path.
    """


@hookspec(firstresult=True)
def dspark_fit(runtime: StartupRuntime, plan: CalibrationPlan, samples: Sequence[CostSample]) -> CostTable | None:
    """Fit the selected cost model on CPU and return an immutable cost table.

    Returns ``None`` to leave fitting to another plugin or the core.
    """


@hookspec
def dspark_install_table(runtime: StartupRuntime, table: CostTable) -> None:
    """Install ``table`` on this worker before the engine reports ready.

    Every implementation runs, on every rank, before the core installs it. The
    table is immutable; an implementation may check it (and raise) but never change it.
    """


# --------------------------------------------------------------------------
# Step stages, in order: proposal -> budget selection -> verification -> commit.
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def dspark_propose(step: DecodeStep) -> Proposal | None:
    """Run the draft for the step's live requests.

    Return the proposal (K drafted tokens and K confidences per request) or
    ``None`` to let another plugin or the core propose.
    """


@hookspec(firstresult=True)
def dspark_select_budget(step: DecodeStep, proposal: Proposal) -> Budget | None:
    """Choose the target-row tier and per-request verify lengths.

    The core's stage delegates to the configured budget policy; ``None``
    leaves the choice to it. A budget may leave ``lengths`` None only for the
    core's own verify, which then splits the tier's draft rows with the
    allocate kernel inside its graph key. Must be deterministic
    for equal inputs (every rank computes the same budget) and may not change
    drafted tokens.
    """


@hookspec(firstresult=True)
def dspark_verify(step: DecodeStep, proposal: Proposal, budget: Budget) -> Verification | None:
    """Pack the admitted rows, run the target and greedily accept prefixes.

    Return the verification result (accepted lengths and the target's greedy
    tokens) or ``None`` to let another plugin or the core verify. While a
    plugin implements this hook, the core's budget always carries its lengths.
    The core's verify also commits (``Verification.committed``); a plugin's
    result is committed by the core afterwards.
    """


@hookspec
def dspark_commit(step: DecodeStep, verification: Verification) -> None:
    """Publish a verified step: committed tokens, KV lengths, confidences.

    Every implementation runs, after the core's own commit wrote the step to
    slot storage (observers such as metrics). They must only read ``verification``.
    """
