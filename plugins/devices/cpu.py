"""The CPU device: always available; float32, static graphs, gloo for multi-rank."""

from __future__ import annotations

import os
from typing import Any

from attrs import frozen

from dspark_core.components import Component
from dspark_core.device import DeviceSpec
from dspark_core.hookspecs import hookimpl


@frozen
class CpuDevice(DeviceSpec):
    """The CPU spec; at launch it applies ``--cpu_threads`` (0 keeps PyTorch's default)."""

    def prepare_launch(self, config: Any) -> None:
        if config.cpu_threads > 0:
            import torch

            torch.set_num_threads(config.cpu_threads)


@hookimpl
def dspark_components() -> list[Component]:
    # lowest priority: --device=auto falls back to the CPU when no accelerator is usable
    return [Component("device", "cpu", "host CPU via PyTorch", auto_priority=0)]


@hookimpl
def dspark_device(name: str) -> DeviceSpec | None:
    if name != "cpu":
        return None
    return CpuDevice(
        name="cpu",
        torch_device="cpu",
        default_dtype="float32",
        default_graph_backend="static",
        distributed_backend="gloo",
        description=f"{os.cpu_count()} logical cores",
    )
