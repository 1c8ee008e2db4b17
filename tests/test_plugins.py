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
    with pytest.raises(PluginError, match=r"unknown hook"):
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
