"""The seams that replaced hard-coded plugin knowledge in the core (issue 19).

Each test states what a plugin now answers instead of the core: the device
order of ``--device=auto``, device-specific launch flags, legacy cost-table
params, tensor-parallel sharding, and the tier scan the policies share.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import structlog
import torch

from dspark_core.components import Component
from dspark_core.config import parse_serve_args
from dspark_core.device import DeviceSpec, import_runtime, resolve_draft_dtype, resolve_dtype
from dspark_core.distributed.launch import shard_target
from dspark_core.errors import ConfigError, TableError
from dspark_core.geometry import legal_tiers
from dspark_core.hookspecs import hookimpl
from dspark_core.plugins import Hooks, build_plugin_manager, default_hooks
from dspark_core.policy import StepPlan, TierContext, best_rate_tier
from dspark_core.startup import pick_device
from dspark_core.table import loads_table
from dspark_plugins.policies.adaptive import AdaptivePolicy


def _hooks(*plugins: object) -> Hooks:
    pm = build_plugin_manager()
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"test-plugin-{i}")
    return Hooks(pm)


# -- --device=auto -----------------------------------------------------------------------


def test_auto_device_order_comes_from_the_device_plugins():
    assert default_hooks().auto_device_names() == ["cuda", "npu", "cpu"]


class FastDevice:
    """A device plugin that outranks CUDA for --device=auto, usable or not."""

    def __init__(self, usable: bool) -> None:
        self.usable = usable

    @hookimpl
    def dspark_components(self):
        return [Component("device", "fast", "a test accelerator", auto_priority=99),
                Component("device", "manual", "never picked by auto")]

    @hookimpl
    def dspark_device(self, name):
        if name == "manual":
            return DeviceSpec("manual", "cpu", "float32", "static", "gloo")
        if name != "fast":
            return None
        if not self.usable:
            raise ConfigError("device=fast: not here")
        return DeviceSpec("fast", "cpu", "float32", "static", "gloo")


def test_auto_picks_the_highest_usable_priority_and_falls_back():
    assert pick_device(_hooks(FastDevice(usable=True)), "auto").name == "fast"
    hooks = _hooks(FastDevice(usable=False))
    assert hooks.auto_device_names()[0] == "fast" and "manual" not in hooks.auto_device_names()
    expected = "cuda" if torch.cuda.is_available() else "cpu"  # no torch_npu on the test hosts
    assert pick_device(hooks, "auto").name == expected
    assert pick_device(hooks, "manual").name == "manual"


def test_only_devices_declare_an_auto_priority():
    with pytest.raises(ValueError, match="auto_priority is for devices only"):
        Component("cost_model", "flat", auto_priority=1)


# -- device-specific launch flags ------------------------------------------------------


def test_the_cpu_device_applies_cpu_threads(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    cpu = default_hooks().device("cpu")
    cpu.prepare_launch(parse_serve_args(["--model=m", "--cpu_threads=3"]))
    cpu.prepare_launch(parse_serve_args(["--model=m", "--cpu_threads=0"]))  # 0 (auto): PyTorch's default is kept
    cpu.prepare_launch(parse_serve_args(["--model=m"]))  # the flag's default, auto
    cpu.prepare_launch(parse_serve_args(["--model=m", "--nnodes=2"]))  # auto with ranks sharing a host: one each
    cpu.prepare_launch(parse_serve_args(["--model=m", "--nnodes=2", "--cpu_threads=2"]))
    assert calls == [3, 1, 2]
    # the count a saved table records: the flag's, or the process's own for auto
    assert cpu.intra_op_threads(parse_serve_args(["--model=m", "--cpu_threads=3"])) == 3
    assert cpu.intra_op_threads(parse_serve_args(["--model=m"])) == torch.get_num_threads()
    assert cpu.intra_op_threads(parse_serve_args(["--model=m", "--nnodes=4"])) == 1
    assert DeviceSpec("plain", "cuda", "float32", "cudagraph", "nccl").intra_op_threads(None) is None
    DeviceSpec("plain", "cpu", "float32", "static", "gloo").prepare_launch(None)  # the base spec does nothing


def test_the_cpu_device_warns_when_bfloat16_would_be_emulated(monkeypatch):
    import dspark_plugins.devices.cpu as cpu_plugin

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    cpu = default_hooks().device("cpu")
    for native, flags, expected in [
        (False, ["--draft_dtype=bfloat16"], [{"draft_dtype": "bfloat16"}]),
        (False, ["--dtype=bfloat16"], [{"dtype": "bfloat16"}]),
        (False, [], []),  # auto: nothing asked, nothing to warn about
        (True, ["--dtype=bfloat16", "--draft_dtype=bfloat16"], []),  # native: bfloat16 is the fast choice
    ]:
        monkeypatch.setattr(cpu_plugin, "native_bfloat16", lambda native=native: native)
        with structlog.testing.capture_logs() as logs:
            cpu.prepare_launch(parse_serve_args(["--model=m", *flags]))
        warnings = [{k: e[k] for k in ("dtype", "draft_dtype") if k in e} for e in logs if e["log_level"] == "warning"]
        assert warnings == expected, (native, flags, logs)
        assert all("emulated" in e["event"] for e in logs if e["log_level"] == "warning")


def test_the_cuda_device_defaults_to_exact_float32_and_turns_tf32_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device=cuda: this PyTorch build sees no CUDA device"):
        default_hooks().device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    cuda = default_hooks().device("cuda")
    assert (cuda.description, cuda.default_graph_backend) == ("NVIDIA H200", "cudagraph")
    # greedy exactness by default: float32 for target and draft; bfloat16 only when asked for
    assert resolve_dtype("auto", cuda) == "float32" and resolve_draft_dtype("auto", cuda, "float32") == "float32"
    assert resolve_dtype("bfloat16", cuda) == "bfloat16"
    # process-wide switches (handled by __getattr__, which monkeypatch cannot restore): saved by hand
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
        cuda.prepare_launch(parse_serve_args(["--model=m"]))
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def test_the_npu_device_reports_its_environment_at_launch(monkeypatch):
    module = types.ModuleType("torch_npu")
    module.npu = types.SimpleNamespace(is_available=lambda: True)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
    with structlog.testing.capture_logs() as logs:
        npu = default_hooks().device("npu")
        npu.prepare_launch(parse_serve_args(["--model=m", "--npu_kernel_backend=TORCH"]))
    reports = [e for e in logs if e["event"] == "npu environment"]
    assert len(reports) == 2 and reports[-1]["npu_kernel_backend"] == "TORCH"


def test_import_runtime_names_what_is_missing():
    with pytest.raises(ConfigError, match=r"^device=x: no_such_runtime_mod is not importable \(.*\); get it"):
        import_runtime("no_such_runtime_mod", needed_for="device=x", hint="get it")


# -- legacy cost tables -----------------------------------------------------------------


def test_cost_models_turn_their_legacy_documents_into_params():
    sps = default_hooks().cost_model("sps")
    params, width = sps.read_legacy({"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [9.0, 8.0],
                                     "max_batch_tokens": 8, "draft_width": 5}, "old.json")
    assert params == {"target_rows": [1, 8], "steps_per_second": [9.0, 8.0], "request_buckets": None, "max_rows": 8}
    assert width == 5
    additive = default_hooks().cost_model("additive")
    params, width = additive.read_legacy({"bias_seconds": 0.1, "bs_probes": [1], "alpha_seconds": [0.0],
                                          "m_probes": [1, 2], "theta_seconds": [0.0, 0.1]}, "old.json")
    assert params["request_buckets"] == [1] and params["target_rows"] == [1, 2] and width is None
    with pytest.raises(ConfigError, match=r"old.json: unknown key\(s\) \(extra\) @ \$"):
        additive.read_legacy({"bias_seconds": 0.1, "bs_probes": [1], "alpha_seconds": [0.0], "m_probes": [1],
                              "theta_seconds": [0.0], "extra": 1}, "old.json")


class SpsWithoutLegacy:
    """A replacement ``sps`` model that does not read legacy files."""

    name = "sps"

    def fit(self, samples, draft_width):
        raise NotImplementedError

    def load(self, params, draft_width):
        raise NotImplementedError


def test_a_model_without_read_legacy_refuses_a_legacy_table():
    pm = build_plugin_manager(("no:sps",))

    class Plugin:
        @hookimpl
        def dspark_cost_model(self, name):
            return SpsWithoutLegacy() if name == "sps" else None

    pm.register(Plugin(), name="replacement-sps")
    legacy = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [9.0, 8.0], "max_batch_tokens": 8}
    with pytest.raises(TableError, match=r"old.json: a legacy steps-per-second table .* 'sps' cost model.*no read_legacy"):
        loads_table(json.dumps(legacy), Hooks(pm).cost_model, "old.json")


# -- tensor-parallel sharding --------------------------------------------------------------


class NoShardFamily:
    name = "flat-family"


def test_sharding_is_the_model_family_s_method():
    from dspark_core.distributed.tp import TensorParallelLlama
    from dspark_core.models.random_models import random_target

    target = random_target(seed=1)
    with pytest.raises(ConfigError, match=r"over 2 ranks: the 'flat-family' model family cannot shard its target "
                                          r"\(LlamaTarget\); run it with --nnodes=1"):
        shard_target(NoShardFamily(), target, 0, 2)
    shard_target(NoShardFamily(), target, 0, 1)  # one rank: nothing to cut
    llama = default_hooks().model_family("llama")
    shard_target(llama, target, 1, 2)
    assert isinstance(target, TensorParallelLlama) and target.tp_rank == 1 and target.tp_size == 2


# -- the tier scan the policies share -------------------------------------------------------


# NaN forecasts (fallback choices) compare unequal, so choices are compared by repr
def _random_case(rng: np.random.Generator) -> tuple[TierContext, np.ndarray, np.ndarray]:
    width = int(rng.integers(2, 8))
    bucket = int(rng.choice([1, 2, 4]))
    live = int(rng.integers(1, bucket + 1))
    tiers = legal_tiers(bucket, width)
    costs = np.sort(rng.uniform(0.5, 2.0, len(tiers)))
    if rng.random() < 0.3:
        costs[rng.integers(0, len(tiers))] = np.nan  # a tier the table does not cover
    ctx = TierContext(bucket, live, width, tiers, costs, forecast_scale=float(rng.uniform(0.3, 1.5)))
    confidences = rng.uniform(0.0, 1.0, (bucket, width))
    caps = rng.integers(0, width + 1, bucket)
    return ctx, confidences, caps


def test_min_gain_decides_like_the_adaptive_rule_without_draft_off_or_correction():
    hooks = default_hooks()
    rng = np.random.default_rng(19)
    for gain in (0.0, 0.04, 0.3):
        peer = hooks.budget_policy("min-gain", {"min_gain": gain})
        adaptive = AdaptivePolicy(min_gain=gain, name="min-gain", draft_off=False, forecast_correction=False)
        for _ in range(200):
            ctx, confidences, caps = _random_case(rng)
            assert repr(peer.choose_tier(ctx, confidences, caps)) == repr(adaptive.choose_tier(ctx, confidences, caps))
            assert peer.plan(ctx, confidences, caps) == adaptive.plan(ctx, confidences, caps) == StepPlan()


def test_adaptive_choose_tier_is_the_core_scan():
    rng = np.random.default_rng(7)
    policy = AdaptivePolicy(min_gain=0.05)
    for _ in range(200):
        ctx, confidences, caps = _random_case(rng)
        assert repr(policy.choose_tier(ctx, confidences, caps)) == repr(best_rate_tier(ctx, confidences, caps, 0.05))
