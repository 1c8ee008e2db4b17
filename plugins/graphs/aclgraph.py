"""``aclgraph``: torch_npu's NPU graph per binding key (Ascend). torch_npu is imported lazily.

Selecting the backend resolves the graph API once (so a host without
torch_npu, or a torch_npu without NPU graphs, fails at selection with one
clear error rather than at the first capture); nothing is imported when the
plugin module itself is imported.
"""

from __future__ import annotations

from dspark_core.components import Component
from dspark_core.device import import_runtime
from dspark_core.errors import ConfigError
from dspark_core.graphs import CapturedGraphBackend, GraphApi
from dspark_core.hookspecs import hookimpl

_GRAPH_CALLS = ("NPUGraph", "graph", "Stream", "stream", "current_stream")


def npu_graph_api() -> GraphApi:
    """The NPU counterparts of the CUDA graph calls (torch_npu registers ``torch.npu``)."""
    # the same message as the npu device's: aclgraph runs only on that device
    import_runtime("torch_npu", needed_for="device=npu", hint="install dspark-core[npu] on an Ascend host")
    import torch

    npu = getattr(torch, "npu", None)
    missing = [name for name in _GRAPH_CALLS if npu is None or not hasattr(npu, name)]
    if npu is None or missing:
        raise ConfigError(f"python_graph_backend=aclgraph: torch.npu lacks {', '.join(missing)}; "
                          "this torch_npu build has no NPU graph support")
    return GraphApi(npu.NPUGraph, npu.graph, npu.Stream, npu.stream, npu.current_stream)


class AclGraphBackend(CapturedGraphBackend):
    name = "aclgraph"

    def __init__(self, device: str, api: GraphApi | None = None) -> None:
        super().__init__(device)
        self._api = api

    def _graph_api(self) -> GraphApi:
        if self._api is None:
            self._api = npu_graph_api()
        return self._api


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("graph_backend", "aclgraph", "torch_npu NPU graph per binding key (Ascend only)")]


@hookimpl
def dspark_graph_backend(name: str, device) -> AclGraphBackend | None:
    if name != "aclgraph":
        return None
    if device.name != "npu":
        raise ConfigError(f"python_graph_backend=aclgraph needs device=npu, not {device.name}")
    return AclGraphBackend(device.torch_device, npu_graph_api())
