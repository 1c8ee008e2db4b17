"""The three device kernels of a decode step, per draft width.

Each kernel has a portable torch reference (``*_reference``) and a variant
specialised for a fixed width K, built once per supported width. The width is
part of every graph binding key, so a launch only ever uses one set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from attrs import frozen

from dspark_kernels.accept_commit import Acceptance, accept_reference, make_accept
from dspark_kernels.allocate import allocate_reference, make_allocate
from dspark_kernels.pack import PackedRows, make_pack, pack_reference

SPECIALISED_WIDTHS = (5, 7)


@frozen
class KernelSet:
    """The allocate, pack and accept kernels for one draft width."""

    width: int
    # (confidences [n, K], caps [n], draft rows) -> verify length per request [n]
    allocate: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]  # draft rows: int or 0-dim tensor
    # (anchors, drafts, lengths, start positions, slots, tier rows, scratch slot) -> the tier's rows
    pack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], PackedRows]
    # (drafts [n, K], lengths [n], target grid [n, K + 1]) -> accepted prefix and committed tokens
    accept: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Acceptance]


def _build(width: int) -> KernelSet:
    return KernelSet(width, make_allocate(width), make_pack(width), make_accept(width))


_SETS = {width: _build(width) for width in SPECIALISED_WIDTHS}


def kernels_for(width: int) -> KernelSet:
    """The width-specialised set for K=5/7; other widths (fixed-width serving) get one built on demand."""
    if width not in _SETS:
        _SETS[width] = _build(width)
    return _SETS[width]


__all__ = [
    "KernelSet", "kernels_for", "SPECIALISED_WIDTHS",
    "allocate_reference", "pack_reference", "accept_reference",
]
