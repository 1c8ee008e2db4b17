"""What a device plugin returns: enough to place tensors and pick defaults."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch
from attrs import frozen

from dspark_core.errors import ConfigError


@frozen
class DeviceSpec:
    """A usable device. ``torch_device`` is what ``torch.device()`` accepts."""

    name: str
    torch_device: str
    default_dtype: str
    default_graph_backend: str
    distributed_backend: str
    description: str = ""
    default_draft_dtype: str | None = None  # None: the draft computes in the target's dtype
    # --draft_depths=auto: (smallest request bucket, tokens the draft proposes from it on) pairs,
    # ascending; buckets below the first pair, and every bucket without pairs, propose all K
    default_draft_depths: tuple[tuple[int, int], ...] = ()

    def prepare_launch(self, config: Any) -> None:
        """Apply device-specific serve flags once the launch picked this device (before anything loads).

        ``config`` is the :class:`dspark_core.config.ServeConfig`. Nothing by
        default; a device plugin subclasses this spec to act on its own flags
        (the CPU plugin sets ``--cpu_threads``, the NPU plugin logs its
        environment and checks ``--npu_kernel_backend``).
        """

    def intra_op_threads(self, config: Any) -> int | None:
        """Host threads a launch of ``config`` computes with, where they set its step costs (a CPU).

        A saved cost table records the count and is reused only with the same one. None by
        default: on an accelerator the host threads do not price a step.
        """
        return None


def import_runtime(module: str, *, needed_for: str, hint: str) -> ModuleType:
    """Import a device's optional runtime library, or raise a ConfigError that says how to get it.

    For plugins that must import a vendor library (torch_npu, ...) lazily, when
    their device or backend is selected, and never at plugin import.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{needed_for}: {module} is not importable ({exc}); {hint}") from None


def resolve_dtype(requested: str, device: DeviceSpec) -> str:
    """Turn ``auto`` into the device's default dtype; pass explicit dtypes through."""
    return device.default_dtype if requested == "auto" else requested


def resolve_draft_dtype(requested: str, device: DeviceSpec, target_dtype: str) -> str:
    """Turn the draft's ``auto`` into the device's draft default, else the target's resolved dtype."""
    if requested != "auto":
        return requested
    return device.default_draft_dtype or target_dtype


def stages_through_pinned_memory(device: torch.device | str) -> bool:
    """True where a host-to-device copy from ordinary (pageable) memory makes the host wait.

    On CUDA such a copy returns only once the stream has run everything queued before it, which
    would make the host building step t+1 wait for step t (schedule overlap lost). A copy from
    pinned memory with ``non_blocking=True`` is queued behind that work instead. Ascend NPUs copy
    from pageable memory synchronously too, and torch_npu pins host memory the same way. The type
    is read from the string, because ``torch.device("npu")`` exists only once torch_npu is imported.
    """
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    return kind in ("cuda", "npu")


def host_to_device(values: Sequence[int] | np.ndarray, device: torch.device | str,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor of host values on ``device``, copied without making the host wait where that matters.

    Through pinned memory and a non-blocking copy on CUDA (PyTorch's pinned-memory cache keeps
    the host block until the copy has run); a plain copy elsewhere.
    """
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    if stages_through_pinned_memory(device):
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
