"""``cudagraph``: one ``torch.cuda.CUDAGraph`` per binding key, captured at warmup, replayed after."""

from __future__ import annotations

from dspark_core.components import Component
from dspark_core.errors import ConfigError
from dspark_core.graphs import CapturedGraphBackend, GraphApi, cuda_graph_api
from dspark_core.hookspecs import hookimpl


class CudaGraphBackend(CapturedGraphBackend):
    name = "cudagraph"

    def _graph_api(self) -> GraphApi:
        return cuda_graph_api()


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("graph_backend", "cudagraph", "torch.cuda.CUDAGraph per binding key (CUDA only)")]


@hookimpl
def dspark_graph_backend(name: str, device) -> CudaGraphBackend | None:
    if name != "cudagraph":
        return None
    if device.name != "cuda":
        raise ConfigError(f"python_graph_backend=cudagraph needs device=cuda, not {device.name}")
    return CudaGraphBackend(device.torch_device)
