"""Ascend NPUs through torch_npu (optional extra ``dspark-core[npu]``).

torch_npu is imported only when the NPU is selected, never at plugin import,
so hosts without it load this plugin fine and get one clear error if they ask
for the NPU.
"""

from __future__ import annotations

import importlib
import os

from dspark_core.components import Component
from dspark_core.device import DeviceSpec
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl


def import_torch_npu() -> object:
    """Import torch_npu or raise a ConfigError that says how to get it."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise ConfigError(
            f"device=npu: torch_npu is not importable ({exc}); install dspark-core[npu] on an Ascend host"
        ) from None


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("device", "npu", "Ascend NPU via torch_npu (optional)")]


@hookimpl
def dspark_device(name: str) -> DeviceSpec | None:
    if name != "npu":
        return None
    torch_npu = import_torch_npu()
    npu = getattr(torch_npu, "npu", None)
    if npu is None or not npu.is_available():
        raise ConfigError("device=npu: torch_npu is installed but reports no available NPU")
    mode = os.environ.get("HCCL_OP_EXPANSION_MODE", "<unset>")
    return DeviceSpec(
        name="npu",
        torch_device="npu",
        default_dtype="bfloat16",
        default_graph_backend="aclgraph",
        distributed_backend="hccl",
        description=f"HCCL_OP_EXPANSION_MODE={mode}",
    )
