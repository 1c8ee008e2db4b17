"""``static``: preallocated buffers per binding key, warmed before ready, run eagerly (CPU)."""

from __future__ import annotations

from dspark_core.components import Component
from dspark_core.graphs import EagerStaticBackend
from dspark_core.hookspecs import hookimpl


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("graph_backend", "static", "preallocated per-key buffers, warmed at startup, eager run")]


@hookimpl
def dspark_graph_backend(name: str, device) -> EagerStaticBackend | None:
    if name != "static":
        return None
    return EagerStaticBackend(device.torch_device)
