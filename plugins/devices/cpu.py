"""The CPU device: always available; float32, static graphs, gloo for multi-rank."""

from __future__ import annotations

import os

from dspark_core.components import Component
from dspark_core.device import DeviceSpec
from dspark_core.hookspecs import hookimpl


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("device", "cpu", "host CPU via PyTorch")]


@hookimpl
def dspark_device(name: str) -> DeviceSpec | None:
    if name != "cpu":
        return None
    return DeviceSpec(
        name="cpu",
        torch_device="cpu",
        default_dtype="float32",
        default_graph_backend="static",
        distributed_backend="gloo",
        description=f"{os.cpu_count()} logical cores",
    )
