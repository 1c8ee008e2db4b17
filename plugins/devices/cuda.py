"""NVIDIA GPUs through torch.cuda; selected only when CUDA is actually usable.

The default dtype is float32 with TF32 off, because greedy output must be
token-identical to target-only decoding: verify rows run in other batch shapes
than target-only rows, and bfloat16 rounding then flips near-tie tokens. On
the first H200 run (`generate`, 8 held-out prompts, 64 tokens) bfloat16 left
target-only greedy on 4 of 8 prompts and float32 on none, and float32 was also
the faster of the two there (the step was host-bound). ``--dtype=bfloat16`` is
the opt-in fast mode; the bench classifies its differences as near-ties or
real (``dspark_core.bench.exactness``).
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from dspark_core.components import Component
from dspark_core.device import DeviceSpec
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl


@frozen
class CudaDevice(DeviceSpec):
    """The CUDA spec; at launch it turns TF32 off, so float32 products are full float32 products."""

    def prepare_launch(self, config: Any) -> None:
        import torch

        # TF32 rounds float32 products to a 10-bit mantissa: enough to flip near-tie greedy tokens
        # between differently shaped batches. PyTorch's default is already off for matmuls; a
        # launch must not depend on what the environment or an imported library switched on.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def cuda_spec(description: str) -> CudaDevice:
    """The spec of a usable CUDA device called ``description``."""
    return CudaDevice(
        name="cuda",
        torch_device="cuda",
        default_dtype="float32",
        default_graph_backend="cudagraph",
        distributed_backend="nccl",
        description=description,
    )


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
    return cuda_spec(torch.cuda.get_device_name(0))
