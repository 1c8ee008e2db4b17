"""NPU device and aclgraph backend, tested honestly on a CPU host.

What can be checked here: selection without torch_npu fails with one clear
ConfigError each; with a fake ``torch_npu`` (and a fake ``torch.npu``) the
selection logic, the HCCL_OP_EXPANSION_MODE report and the aclgraph GraphApi
resolution work; ``--npu_kernel_backend`` is validated; and no module imports
torch_npu at import time. What cannot: real NPU kernels, ACL graph capture and
replay, and HCCL collectives (no Ascend hardware here).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import structlog
import torch

from dspark_core.device import DeviceSpec
from dspark_core.errors import ConfigError
from dspark_core.graphs import BindingKey
from dspark_core.models.glm_dsa.static import static_shapes_active
from dspark_core.plugins import Hooks, build_plugin_manager

NPU = DeviceSpec("npu", "npu", "bfloat16", "aclgraph", "hccl")


@pytest.fixture
def hooks():
    return Hooks(build_plugin_manager())


@pytest.fixture
def no_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # "import torch_npu" now raises ImportError


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class FakeStream:
    def wait_stream(self, other):
        pass


class FakeContext:
    def __init__(self, *args):
        self.args = args

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """A stand-in for torch_npu: the module, its ``npu`` namespace and the ``torch.npu`` it registers."""
    module = types.ModuleType("torch_npu")
    module.npu = types.SimpleNamespace(is_available=lambda: True)
    runtime = types.SimpleNamespace(NPUGraph=FakeGraph, graph=FakeContext, Stream=FakeStream, stream=FakeContext,
                                    current_stream=FakeStream)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", runtime, raising=False)
    return module


def test_npu_device_without_torch_npu_is_one_clear_error(hooks, no_torch_npu):
    with pytest.raises(ConfigError, match=r"^device=npu: torch_npu is not importable .*dspark-core\[npu\]"):
        hooks.device("npu")


def test_aclgraph_without_torch_npu_is_one_clear_error(hooks, no_torch_npu):
    with pytest.raises(ConfigError, match=r"torch_npu is not importable .*Ascend host"):
        hooks.graph_backend("aclgraph", NPU)


def test_npu_device_selected_with_fake_torch_npu_reports_hccl_mode(hooks, fake_torch_npu, monkeypatch):
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
    with structlog.testing.capture_logs() as logs:
        spec = hooks.device("npu")
    assert (spec.name, spec.torch_device, spec.default_graph_backend, spec.distributed_backend) == \
        ("npu", "npu", "aclgraph", "hccl")
    assert spec.description == "HCCL_OP_EXPANSION_MODE=AIV"
    env = [e for e in logs if e["event"] == "npu environment"]
    assert env and env[0]["hccl_op_expansion_mode"] == "AIV" and env[0]["npu_kernel_backend"] == "TORCH"
    assert not [e for e in logs if e["log_level"] == "warning"]
    import os
    assert os.environ["HCCL_OP_EXPANSION_MODE"] == "AIV"  # passed through untouched


def test_hccl_mode_unset_or_unknown_is_reported_not_changed(hooks, fake_torch_npu, monkeypatch):
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    with structlog.testing.capture_logs():
        assert hooks.device("npu").description == "HCCL_OP_EXPANSION_MODE=<unset>"
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "SOMETHING")
    with structlog.testing.capture_logs() as logs:
        assert hooks.device("npu").description == "HCCL_OP_EXPANSION_MODE=SOMETHING"
    assert [e["value"] for e in logs if e["log_level"] == "warning"] == ["SOMETHING"]


def test_npu_present_but_unavailable_is_clear(hooks, fake_torch_npu):
    fake_torch_npu.npu = types.SimpleNamespace(is_available=lambda: False)
    with structlog.testing.capture_logs(), pytest.raises(ConfigError, match="reports no available NPU"):
        hooks.device("npu")


def test_aclgraph_resolves_its_graph_api_from_torch_npu(hooks, fake_torch_npu):
    backend = hooks.graph_backend("aclgraph", NPU)
    api = backend._graph_api()
    assert api.graph_class is FakeGraph and api.graph is torch.npu.graph and api.Stream is FakeStream
    assert api.stream is torch.npu.stream and api.current_stream is torch.npu.current_stream
    # the capture/replay plumbing with the fake runtime (a real NPU graph is not exercised here)
    key = BindingKey(7, 1, 8, "bfloat16", "npu")
    modes = []

    def fn(x):
        modes.append(static_shapes_active())
        return (x * 2,)

    backend.prepare(key, fn, {"x": torch.ones(2)})
    assert modes and all(modes) and not static_shapes_active()  # targets run static-shape while captured
    (out,) = backend.run(key, {"x": torch.ones(2)})
    assert backend.counters.captures == 1 and backend.counters.replays == 1 and out.tolist() == [2.0, 2.0]
    assert backend._prepared[key].graph.replays == 1


def test_aclgraph_needs_npu_graphs_in_torch_npu(hooks, fake_torch_npu, monkeypatch):
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(Stream=FakeStream), raising=False)
    with pytest.raises(ConfigError, match="torch.npu lacks NPUGraph, graph, stream, current_stream"):
        hooks.graph_backend("aclgraph", NPU)


def test_npu_kernel_backend_flag(tmp_path):
    from dspark_plugins.devices.npu import check_npu_kernel_backend
    from dspark_plugins.models.glm_dsa import GlmDsaFamily

    assert check_npu_kernel_backend("TORCH") == "TORCH" and check_npu_kernel_backend("torch") == "TORCH"
    with pytest.raises(ConfigError, match="npu_kernel_backend=ATB: supported values are TORCH"):
        check_npu_kernel_backend("ATB")
    with pytest.raises(ConfigError, match="implements only TORCH"):
        GlmDsaFamily().load_target(tmp_path, kernel_backend="ATB")


GUARD = textwrap.dedent("""
    import importlib, importlib.abc, pkgutil, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch_npu" or name.startswith("torch_npu."):
                raise RuntimeError("torch_npu imported at import time")  # not an ImportError: cannot be swallowed
            return None

    sys.meta_path.insert(0, Refuse())
    import dspark_plugins, dspark_core.models.glm_dsa
    names = [m.name for m in pkgutil.walk_packages(dspark_plugins.__path__, "dspark_plugins.")]
    for name in names:
        importlib.import_module(name)
    from dspark_core.plugins import build_plugin_manager
    build_plugin_manager()
    assert "torch_npu" not in sys.modules
    print(len(names), "modules")
""")


def test_no_module_imports_torch_npu_at_import_time():
    out = subprocess.run([sys.executable, "-c", GUARD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[0]) >= 10
