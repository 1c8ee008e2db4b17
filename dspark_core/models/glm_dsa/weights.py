"""Small helpers shared by the GLM-DSA modules: weight lookup, precision, rope on a slice."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dspark_core.errors import ModelError
from dspark_core.models.layers import apply_rope


class Weights:
    """Frozen parameters out of a ``name -> tensor`` dict with shape checks and one clear error."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> None:
        self.tensors = tensors
        self.dtype = dtype
        self.device = device

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelError(f"checkpoint is missing weight {name!r}")
        t = self.tensors[name]
        if tuple(t.shape) != shape:
            raise ModelError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
        return nn.Parameter(self.tensor(name, shape, dtype), requires_grad=False)

    def optional(self, name: str, shape: tuple[int, ...], enabled: bool = True) -> nn.Parameter | None:
        return self.param(name, shape) if enabled else None


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for softmax, router and indexer scores: float32, or float64 for float64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_on_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rotate-half rope on the first ``rope_dim`` features of ``x [N, heads, D]``; the rest pass through."""
    if rope_dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Reorder pairs ``(x0, x1), (x2, x3) ...`` into halves ``(x0, x2, ... | x1, x3, ...)``.

    Rotating the reordered vector with rotate-half rope equals rotating the
    original pairs (interleaved rope); queries and keys are reordered alike, so
    their dot products are unchanged.
    """
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
