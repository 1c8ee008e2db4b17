"""Plugin loading: entry points, --plugin, blocking, validation and the listing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from dspark_core.errors import PluginError
from dspark_core.plugins import Hooks, build_plugin_manager, plugin_report


def test_default_plugins_come_from_entry_points():
    pm = build_plugin_manager()
    names = {info.name for info in plugin_report(pm)}
    assert {"cpu", "cuda", "npu"} <= names
    devices = {c.name for c in Hooks(pm).components("device")}
    assert devices >= {"cpu", "cuda", "npu"}


def test_plugin_report_has_versions_and_hooks():
    report = {info.name: info for info in plugin_report(build_plugin_manager())}
    assert report["cpu"].version == "0.1.0"  # from the dspark-core distribution
    assert report["cpu"].hooks == ("dspark_components", "dspark_device")


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    module = tmp_path / "my_thirdparty_plugin.py"
    module.write_text(textwrap.dedent("""
        from dspark_core.hookspecs import hookimpl
        from dspark_core.components import Component
        __version__ = "9.9"

        @hookimpl
        def dspark_components():
            return [Component("cost_model", "flat", "constant cost")]

        @hookimpl
        def dspark_cost_model(name):
            return "flat-model" if name == "flat" else None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_thirdparty_plugin"


def test_plugin_flag_loads_a_module(third_party):
    pm = build_plugin_manager([third_party])
    hooks = Hooks(pm)
    assert hooks.cost_model("flat") == "flat-model"
    report = {info.name: info for info in plugin_report(pm)}
    assert report[third_party].version == "9.9"


def test_unknown_plugin_is_a_clear_error():
    with pytest.raises(PluginError, match=r"--plugin no_such_plugin_xyz: no entry point and no importable module"):
        build_plugin_manager(["no_such_plugin_xyz"])


def test_broken_plugin_reports_its_import_error(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin_mod.py").write_text("import no_such_dependency_abc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"broken_plugin_mod: importing it failed.*no_such_dependency_abc"):
        build_plugin_manager(["broken_plugin_mod"])


def test_blocking_an_entry_point_plugin_removes_it():
    pm = build_plugin_manager(["no:cuda"])
    assert "cuda" not in {info.name for info in plugin_report(pm)}
    with pytest.raises(PluginError, match=r"no device named 'cuda'"):
        Hooks(pm).device("cuda")


def test_requesting_a_blocked_plugin_is_an_error():
    with pytest.raises(PluginError, match=r"--plugin cuda is also blocked"):
        build_plugin_manager(["no:cuda", "cuda"])


def test_hook_typo_fails_check_pending(tmp_path, monkeypatch):
    (tmp_path / "typo_plugin_mod.py").write_text(
        "from dspark_core.hookspecs import hookimpl\n@hookimpl\ndef dspark_devise(name):\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"plugin 'typo_plugin_mod' \(.*typo_plugin_mod.py\) implements an unknown hook: "
                                          r"unknown hook 'dspark_.*' \(the hooks are listed"):
        build_plugin_manager(["typo_plugin_mod"])


def test_cpu_device_always_available_and_npu_missing_is_clear():
    hooks = Hooks(build_plugin_manager())
    assert hooks.device("cpu").torch_device == "cpu"
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        from dspark_core.errors import ConfigError
        with pytest.raises(ConfigError, match=r"torch_npu is not importable.*dspark-core\[npu\]"):
            hooks.device("npu")


def test_plugins_command_lists_plugins_and_components(third_party, tmp_path):
    env_path = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "dspark_core.cli", "plugins", "--json", "--plugin", third_party],
        capture_output=True, text=True, check=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    data = json.loads(out.stdout)
    names = {p["name"]: p for p in data["plugins"]}
    assert "dspark_cost_model" in names[third_party]["hooks"]
    assert {"kind": "cost_model", "name": "flat", "summary": "constant cost"} in data["components"]
    text = subprocess.run([sys.executable, "-m", "dspark_core.cli", "plugins"], capture_output=True, text=True, check=True)
    assert "cpu" in text.stdout and "dspark_device" in text.stdout


@pytest.fixture
def faulty_policies(tmp_path, monkeypatch):
    """A plugin with the mistakes a policy author makes, one policy name each."""
    (tmp_path / "faulty_policy_plugin.py").write_text(textwrap.dedent("""
        from attrs import frozen
        from dspark_core.hookspecs import hookimpl
        from dspark_core.policy import TierChoice, allocate_split
        from dspark_plugins.policies.fixed import FixedPolicy

        class Bare:  # no name, uses_draft, tier_lag
            def choose_tier(self, ctx, confidences, caps):
                return TierChoice(rows=ctx.full_width)

        @frozen
        class Returns(FixedPolicy):
            what: object = None
            def choose_tier(self, ctx, confidences, caps):
                return TierChoice(rows=ctx.full_width + 5) if self.what == "too-many-rows" else 3

        @hookimpl
        def dspark_budget_policy(name, options):
            if name == "strict":
                return FixedPolicy(**options)  # takes k and nothing else
            if name == "bare":
                return Bare()
            if name in ("too-many-rows", "an-int"):
                return Returns(what=name)
            return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return Hooks(build_plugin_manager(["faulty_policy_plugin"]))


def test_a_policy_that_cannot_take_its_options_or_lacks_attributes_is_named(faulty_policies):
    with pytest.raises(PluginError, match=r"budget policy 'strict' could not be built with options \{'kk': 3\}: "
                                          r"TypeError: .*unexpected keyword argument 'kk'.*ConfigError"):
        faulty_policies.budget_policy("strict", {"kk": 3})
    assert faulty_policies.budget_policy("strict", {"k": 2}).k == 2
    with pytest.raises(PluginError, match=r"budget policy 'bare' \(faulty_policy_plugin.Bare\) lacks name, "
                                          r"uses_draft, tier_lag, split"):
        faulty_policies.budget_policy("bare")


@pytest.mark.parametrize("name, message", [
    ("an-int", r"budget policy 'fixed': choose_tier returned int; expected a dspark_core.policy.TierChoice"),
    ("too-many-rows", r"budget policy 'fixed' chose 17 target rows at request bucket 2; the captured tiers are "
                      r"2, 3, 4, .*, 12 \(dspark_core.policy.smallest_tier rounds up to one\)"),
])
def test_a_tier_choice_the_step_cannot_run_is_refused_naming_the_policy(faulty_policies, name, message):
    from dspark_core.engine.engine import Engine, EngineConfig
    from dspark_core.engine.request import SamplingParams
    from engine_support import tiny_pair

    target, draft = tiny_pair()
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy=name, request_buckets=(1, 2), max_model_len=64),
                    hooks=faulty_policies)
    try:
        with pytest.raises(PluginError, match=message):
            engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4))
    finally:
        engine.close()


def test_a_hook_function_without_hookimpl_is_refused(tmp_path, monkeypatch):
    (tmp_path / "unmarked_plugin_mod.py").write_text("def dspark_budget_policy(name, options):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"--plugin unmarked_plugin_mod: dspark_budget_policy is not marked as a hook "
                                          r"implementation.*@hookimpl"):
        build_plugin_manager(["unmarked_plugin_mod"])


def test_the_budget_policy_example_of_the_docs_runs_and_stays_exact(tmp_path, monkeypatch):
    """docs/plugins.md's my_policy.py, as written there: loaded with --plugin, listed, exact, and its
    option check names a bad option."""
    from pathlib import Path

    from dspark_core.engine.engine import Engine, EngineConfig
    from dspark_core.engine.request import SamplingParams
    from dspark_core.errors import ConfigError
    from engine_support import greedy_references, random_prompts, tiny_pair

    doc = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text(encoding="utf-8")
    example = doc.split("```python\n# my_policy.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_policy.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = Hooks(build_plugin_manager(["my_policy"]))
    assert "up-to" in {c.name for c in hooks.components("budget_policy")}
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['kk'\]"):
        hooks.budget_policy("up-to", {"kk": 3})
    target, draft = tiny_pair()
    prompts = random_prompts(3, seed=4)
    engine = Engine(target, draft, EngineConfig(draft_width=5, policy="up-to", policy_options={"k": 2},
                                                request_buckets=(1, 2, 4), max_model_len=96), hooks=hooks)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.close()
    assert [list(o.token_ids) for o in outputs] == greedy_references(target, prompts, 12)
    # k = 2 per request on average: a step verifies at most twice its requests' count of drafted tokens
    verified, request_steps = sum(sum(o.verify_widths) for o in outputs), sum(len(o.verify_widths) for o in outputs)
    assert request_steps < verified <= 2 * request_steps
