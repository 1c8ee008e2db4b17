"""Hookspec contracts: every hook is documented, has the right result rule and
is reachable through the typed ``Hooks`` wrapper."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pluggy
import pytest

from dspark_core import hookspecs
from dspark_core.components import Component
from dspark_core.errors import PluginError
from dspark_core.hookspecs import hookimpl
from dspark_core.plugins import Hooks

SPECS = {name: fn for name, fn in vars(hookspecs).items() if name.startswith("dspark_") and callable(fn)}

FIRSTRESULT = {
    "dspark_device", "dspark_graph_backend", "dspark_cost_model", "dspark_budget_policy",
    "dspark_model_family", "dspark_calibrate", "dspark_fit", "dspark_propose",
    "dspark_select_budget", "dspark_verify",
}
CALL_ALL = {"dspark_components", "dspark_warmup", "dspark_install_table", "dspark_commit"}


def bare_manager(*plugins: object) -> Hooks:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()
    return Hooks(pm)


def test_every_hook_is_classified_and_documented():
    assert set(SPECS) == FIRSTRESULT | CALL_ALL
    for name, fn in SPECS.items():
        doc = inspect.getdoc(fn) or ""
        assert len(doc.split()) >= 15, f"{name} needs a contract in its docstring"
        opts = getattr(fn, "dspark_core_spec")
        assert opts["firstresult"] is (name in FIRSTRESULT), name


def test_every_hook_has_a_wrapper_method():
    wrapper_source = inspect.getsource(Hooks)
    for name in SPECS:
        assert f"self._hook.{name}(" in wrapper_source, f"Hooks does not call {name}"


class Selector:
    """Answers every selection hook for the name 'mine' only."""

    @hookimpl
    def dspark_components(self):
        return [Component(kind, "mine") for kind in
                ("device", "graph_backend", "cost_model", "budget_policy", "model_family")]

    @hookimpl
    def dspark_device(self, name):
        return ("device", name) if name == "mine" else None

    @hookimpl
    def dspark_graph_backend(self, name, device):
        return ("graph", name, device) if name == "mine" else None

    @hookimpl
    def dspark_cost_model(self, name):
        return ("cost", name) if name == "mine" else None

    @hookimpl
    def dspark_budget_policy(self, name, options):
        return stand_in_policy(name, options) if name == "mine" else None

    @hookimpl
    def dspark_model_family(self, architecture):
        return ("family", architecture) if architecture == "mine" else None


def stand_in_policy(name, options):
    """What the selection checks a policy for (its attributes), carrying the hook's arguments."""
    return SimpleNamespace(name=name, options=dict(options), uses_draft=True, tier_lag=0, choose_tier=None, split=None)


@pytest.mark.parametrize(
    "method,args,expected",
    [
        ("device", ("mine",), ("device", "mine")),
        ("graph_backend", ("mine", "dev"), ("graph", "mine", "dev")),
        ("cost_model", ("mine",), ("cost", "mine")),
        ("budget_policy", ("mine", {"k": 3}), stand_in_policy("mine", {"k": 3})),
        ("model_family", ("mine",), ("family", "mine")),
    ],
)
def test_selection_hooks_return_first_match_and_name_alternatives(method, args, expected):
    hooks = bare_manager(Selector())
    assert getattr(hooks, method)(*args) == expected
    missing = ("other",) + args[1:]
    with pytest.raises(PluginError, match=r"named 'other' \(available: mine\)"):
        getattr(hooks, method)(*missing)


def test_firstresult_stops_at_the_later_registered_plugin():
    class Override:
        @hookimpl
        def dspark_cost_model(self, name):
            return ("override", name) if name == "mine" else None

    hooks = bare_manager(Selector(), Override())
    assert hooks.cost_model("mine") == ("override", "mine")


class Stages:
    def __init__(self):
        self.calls = []

    @hookimpl
    def dspark_warmup(self, runtime):
        self.calls.append(("warmup", runtime))

    @hookimpl
    def dspark_calibrate(self, runtime, plan):
        return [("sample", plan)]

    @hookimpl
    def dspark_fit(self, runtime, plan, samples):
        return ("table", tuple(samples))

    @hookimpl
    def dspark_install_table(self, runtime, table):
        self.calls.append(("install", table))

    @hookimpl
    def dspark_propose(self, step):
        return ("proposal", step)

    @hookimpl
    def dspark_select_budget(self, step, proposal):
        return ("budget", proposal)

    @hookimpl
    def dspark_verify(self, step, proposal, budget):
        return ("verified", budget)

    @hookimpl
    def dspark_commit(self, step, verification):
        self.calls.append(("commit", verification))


def test_stage_hooks_run_in_pipeline_order():
    stages, observer = Stages(), Stages()
    hooks = bare_manager(stages, observer)
    hooks.warmup("rt")
    samples = hooks.calibrate("rt", "plan")
    table = hooks.fit("rt", "plan", samples)
    hooks.install_table("rt", table)
    proposal = hooks.propose("step")
    budget = hooks.select_budget("step", proposal)
    verification = hooks.verify("step", proposal, budget)
    hooks.commit("step", verification)
    assert table == ("table", (("sample", "plan"),))
    assert verification == ("verified", ("budget", ("proposal", "step")))
    # call-all hooks reach every implementation
    for plugin in (stages, observer):
        assert plugin.calls == [("warmup", "rt"), ("install", table), ("commit", verification)]


@pytest.mark.parametrize("method,args", [
    ("calibrate", ("rt", "plan")), ("fit", ("rt", "plan", [])), ("propose", ("s",)),
    ("select_budget", ("s", "p")), ("verify", ("s", "p", "b")),
])
def test_a_stage_no_plugin_answers_is_none_so_the_core_runs_its_own(method, args):
    hooks = bare_manager()
    assert getattr(hooks, method)(*args) is None
    assert not hooks.implements(f"dspark_{method}")
    assert bare_manager(Stages()).implements(f"dspark_{method}")
