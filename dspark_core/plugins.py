"""Plugin loading and the one typed wrapper through which code calls hooks.

Plugins come from the ``dspark_core`` entry-point group (the default plugins
are registered there by this project's own ``pyproject.toml``, just as a third
party would do) and from ``--plugin NAME_OR_MODULE``. ``--plugin no:NAME``
blocks an entry-point plugin, pytest style.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy
from attrs import frozen

from dspark_core import hookspecs
from dspark_core.components import Component
from dspark_core.errors import DSparkError, PluginError

if TYPE_CHECKING:  # annotations only: the manager sits below everything it returns
    from dspark_core.calibration.install import StartupRuntime
    from dspark_core.calibration.plan import CalibrationPlan
    from dspark_core.costs.base import CostModel, CostSample
    from dspark_core.device import DeviceSpec
    from dspark_core.engine.engine import Engine
    from dspark_core.engine.step import Budget, DecodeStep, Proposal, Verification
    from dspark_core.graphs import GraphBackend
    from dspark_core.models.base import ModelFamily
    from dspark_core.policy import BudgetPolicy
    from dspark_core.table import CostTable

ENTRY_POINT_GROUP = hookspecs.PROJECT


@frozen
class PluginInfo:
    """One registered plugin as ``dspark-core plugins`` shows it."""

    name: str
    version: str
    hooks: tuple[str, ...]


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _import_plugin(spec: str) -> Any:
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name and spec.startswith(exc.name):
            known = ", ".join(sorted(_entry_points())) or "none"
            raise PluginError(
                f"--plugin {spec}: no entry point and no importable module of that name (entry points: {known})"
            ) from None
        raise PluginError(f"--plugin {spec}: importing it failed: {exc}") from exc
    except Exception as exc:  # a broken plugin must not look like a missing one
        raise PluginError(f"--plugin {spec}: importing it failed: {type(exc).__name__}: {exc}") from exc


def build_plugin_manager(plugins: Sequence[str] = (), *, autoload: bool = True) -> pluggy.PluginManager:
    """Create a manager with the hookspecs, entry-point plugins and ``plugins`` loaded.

    ``plugins`` holds ``--plugin`` values: an entry-point name (loaded even when
    ``autoload`` is off), a dotted module path, or ``no:NAME`` to block one.
    Raises :class:`PluginError` for unknown, blocked or broken plugins, and for
    hook implementations that match no hookspec (``check_pending``).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = [p[3:] for p in plugins if p.startswith("no:")]
    wanted = [p for p in plugins if not p.startswith("no:")]
    for name in blocked:
        if name in wanted:
            raise PluginError(f"--plugin {name} is also blocked by --plugin no:{name}")
        pm.set_blocked(name)
    entry_points = _entry_points()
    versions: dict[str, str] = {}
    pm.dspark_versions = versions  # type: ignore[attr-defined]  # read by plugin_report
    to_load = list(entry_points) if autoload else []
    to_load += [w for w in wanted if w in entry_points and w not in to_load]
    for name in to_load:
        if pm.is_blocked(name):
            continue
        try:
            module = entry_points[name].load()
        except Exception as exc:
            raise PluginError(f"plugin {name!r} ({entry_points[name].value}) failed to load: {exc}") from exc
        pm.register(module, name=name)
        dist = getattr(entry_points[name], "dist", None)
        if dist is not None:
            versions[name] = str(dist.version)
    for spec in wanted:
        if spec in entry_points:
            continue
        if pm.is_blocked(spec):
            raise PluginError(f"--plugin {spec}: this plugin is blocked")
        if pm.has_plugin(spec):
            continue
        module = _import_plugin(spec)
        pm.register(module, name=spec)
        _check_marked(pm, spec, module)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin_name = pm.get_name(exc.plugin)
        where = getattr(exc.plugin, "__file__", None) or plugin_name
        unknown = str(exc.args[0]).replace(f" in plugin {exc.plugin!r}", "")  # pluggy repeats the module's repr
        raise PluginError(f"plugin {plugin_name!r} ({where}) implements an unknown hook: {unknown} (the hooks are listed by "
                          "`dspark-core plugins` and documented in dspark_core/hookspecs.py)") from None
    return pm


def _check_marked(pm: pluggy.PluginManager, spec: str, module: object) -> None:
    """A ``--plugin`` module whose ``dspark_*`` functions lack ``@hookimpl`` would load and do nothing."""
    unmarked = sorted(name for name in dir(module) if name.startswith("dspark_") and callable(getattr(module, name))
                      and pm.parse_hookimpl_opts(module, name) is None)
    if unmarked:
        raise PluginError(f"--plugin {spec}: {', '.join(unmarked)} {'is' if len(unmarked) == 1 else 'are'} not marked "
                          "as a hook implementation, so it would never be called; decorate it with @hookimpl "
                          "(from dspark_core.hookspecs import hookimpl)")


def _plugin_version(pm: pluggy.PluginManager, name: str, plugin: object) -> str:
    versions = getattr(pm, "dspark_versions", {})
    if name in versions:
        return versions[name]
    return str(getattr(plugin, "__version__", "unknown"))


def plugin_report(pm: pluggy.PluginManager) -> list[PluginInfo]:
    """Every registered plugin with its version and the hooks it implements."""
    report = []
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0]):
        if plugin is None:  # blocked
            continue
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()))
        report.append(PluginInfo(name=name, version=_plugin_version(pm, name, plugin), hooks=hooks))
    return report


class Hooks:
    """Typed calls into the plugin pipeline; the only place ``pm.hook`` is used."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self._hook = pm.hook

    # -- discovery and selection ------------------------------------------------
    def components(self, kind: str | None = None) -> list[Component]:
        """All declared components, optionally only those of ``kind``."""
        found = [c for batch in self._hook.dspark_components() for c in batch]
        return [c for c in found if kind is None or c.kind == kind]

    def _select(self, kind: str, name: str, result: Any) -> Any:
        if result is None:
            names = sorted({c.name for c in self.components(kind)})
            hint = ", ".join(names) if names else "none registered"
            raise PluginError(f"no {kind.replace('_', ' ')} named {name!r} (available: {hint})")
        return result

    def auto_device_names(self) -> list[str]:
        """Devices ``--device=auto`` tries, in order: declared ``auto_priority``, highest first."""
        devices = [(c.auto_priority, c.name) for c in self.components("device") if c.auto_priority is not None]
        return [name for _, name in sorted(devices, key=lambda pair: (-pair[0], pair[1]))]

    def device(self, name: str) -> DeviceSpec:
        """The device plugin's spec for ``name``; a ConfigError when it cannot be used here."""
        return self._select("device", name, self._hook.dspark_device(name=name))

    def graph_backend(self, name: str, device: DeviceSpec) -> GraphBackend:
        """A new graph backend ``name`` for ``device``."""
        return self._select("graph_backend", name, self._hook.dspark_graph_backend(name=name, device=device))

    def cost_model(self, name: str) -> CostModel:
        """The cost model ``name``."""
        return self._select("cost_model", name, self._hook.dspark_cost_model(name=name))

    def budget_policy(self, name: str, options: Mapping[str, Any] | None = None) -> BudgetPolicy:
        """A new budget policy ``name`` built with ``options``; a policy object lacking a required
        attribute, or a plugin failing on the options with anything but a clear error, is a
        PluginError naming the policy."""
        from dspark_core.policy import check_policy

        options = dict(options or {})
        try:
            result = self._hook.dspark_budget_policy(name=name, options=options)
        except DSparkError:
            raise
        except Exception as exc:  # e.g. MyPolicy(**options) with an option it does not take
            raise PluginError(f"budget policy {name!r} could not be built with options {options}: "
                              f"{type(exc).__name__}: {exc} (a policy should refuse bad options with "
                              "dspark_core.errors.ConfigError, naming them)") from exc
        policy = self._select("budget_policy", name, result)
        check_policy(name, policy)
        return policy

    def model_family(self, architecture: str) -> ModelFamily:
        """The model family serving checkpoints of ``architecture``."""
        return self._select("model_family", architecture, self._hook.dspark_model_family(architecture=architecture))

    # -- stages -----------------------------------------------------------------
    # The core holds every stage's default implementation and runs it itself; these
    # calls reach the plugins that add to a stage (warmup, install, commit: every
    # implementation runs) or replace it (the others: the first non-None result,
    # None when no plugin answers, and then the core's own stage runs).
    def implements(self, hook_name: str) -> bool:
        """True when a registered plugin implements ``hook_name`` (the engine skips the hook call otherwise)."""
        return bool(getattr(self._hook, hook_name).get_hookimpls())

    def warmup(self, runtime: Engine) -> None:
        self._hook.dspark_warmup(runtime=runtime)

    def calibrate(self, runtime: StartupRuntime, plan: CalibrationPlan) -> Sequence[CostSample] | None:
        return self._hook.dspark_calibrate(runtime=runtime, plan=plan)

    def fit(self, runtime: StartupRuntime, plan: CalibrationPlan, samples: Sequence[CostSample]) -> CostTable | None:
        return self._hook.dspark_fit(runtime=runtime, plan=plan, samples=samples)

    def install_table(self, runtime: StartupRuntime, table: CostTable) -> None:
        self._hook.dspark_install_table(runtime=runtime, table=table)

    def propose(self, step: DecodeStep) -> Proposal | None:
        return self._hook.dspark_propose(step=step)

    def select_budget(self, step: DecodeStep, proposal: Proposal) -> Budget | None:
        return self._hook.dspark_select_budget(step=step, proposal=proposal)

    def verify(self, step: DecodeStep, proposal: Proposal, budget: Budget) -> Verification | None:
        return self._hook.dspark_verify(step=step, proposal=proposal, budget=budget)

    def commit(self, step: DecodeStep, verification: Verification) -> None:
        self._hook.dspark_commit(step=step, verification=verification)


def load_hooks(plugins: Iterable[str] = ()) -> Hooks:
    """Build a plugin manager (entry points + ``plugins``) and wrap it."""
    return Hooks(build_plugin_manager(tuple(plugins)))


@functools.lru_cache(maxsize=1)
def default_hooks() -> Hooks:
    """Process-wide hooks with only the entry-point plugins (for tools and tests)."""
    return load_hooks()

