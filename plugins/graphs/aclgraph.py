"""``aclgraph``: torch_npu's NPU graph per binding key (Ascend). torch_npu is imported lazily."""

from __future__ import annotations

from dspark_core.components import Component
from dspark_core.errors import ConfigError
from dspark_core.graphs import CapturedGraphBackend, GraphApi
from dspark_core.hookspecs import hookimpl
from dspark_plugins.devices.npu import import_torch_npu


def npu_graph_api() -> GraphApi:
    """The NPU counterparts of the CUDA graph calls (torch_npu registers ``torch.npu``)."""
    import_torch_npu()
    import torch

    npu = torch.npu  # type: ignore[attr-defined]
    return GraphApi(npu.NPUGraph, npu.graph, npu.Stream, npu.stream, npu.current_stream)


class AclGraphBackend(CapturedGraphBackend):
    name = "aclgraph"

    def _graph_api(self) -> GraphApi:
        return npu_graph_api()


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("graph_backend", "aclgraph", "torch_npu NPU graph per binding key (Ascend only)")]


@hookimpl
def dspark_graph_backend(name: str, device) -> AclGraphBackend | None:
    if name != "aclgraph":
        return None
    if device.name != "npu":
        raise ConfigError(f"python_graph_backend=aclgraph needs device=npu, not {device.name}")
    return AclGraphBackend(device.torch_device)
