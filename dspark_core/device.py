"""What a device plugin returns: enough to place tensors and pick defaults."""

from __future__ import annotations

from attrs import frozen


@frozen
class DeviceSpec:
    """A usable device. ``torch_device`` is what ``torch.device()`` accepts."""

    name: str
    torch_device: str
    default_dtype: str
    default_graph_backend: str
    distributed_backend: str
    description: str = ""


def resolve_dtype(requested: str, device: DeviceSpec) -> str:
    """Turn ``auto`` into the device's default dtype; pass explicit dtypes through."""
    return device.default_dtype if requested == "auto" else requested
