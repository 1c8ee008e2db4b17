"""NVIDIA GPUs through torch.cuda; selected only when CUDA is actually usable."""

from __future__ import annotations

from dspark_core.components import Component
from dspark_core.device import DeviceSpec
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("device", "cuda", "NVIDIA GPU via torch.cuda", auto_priority=20)]


@hookimpl
def dspark_device(name: str) -> DeviceSpec | None:
    if name != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("device=cuda: this PyTorch build sees no CUDA device (torch.cuda.is_available() is false)")
    return DeviceSpec(
        name="cuda",
        torch_device="cuda",
        default_dtype="bfloat16",
        default_graph_backend="cudagraph",
        distributed_backend="nccl",
        description=torch.cuda.get_device_name(0),
    )
