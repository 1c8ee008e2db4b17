"""CPU matrix products through oneDNN, with each weight reordered into oneDNN's layout once.

Why: decoding multiplies a handful of rows by every weight, so a step's cost is
reading the weights. On the 2-core development machine (AMD EPYC, MKL 2024.2)
``F.linear`` does not stay at that cost: SmolLM2's fused gate/up product took
0.65 ms for 1 row and 0.9-1.7 ms for 2-8 rows, and its LM head 10 ms for 1 row
and 17-36 ms for 2-8 rows. The same products on a packed weight run at
0.29-0.33 ms and 4.5-6 ms for every row count from 1 to 8 and stay faster up to
thousands of rows (``benchmarks/cpu_linear.py`` measures it). A verify forward
of 8 rows then costs about what a 1-row target-only step costs, the premise
speculative decoding rests on.

A packed weight is a copy (the target's weights are held twice on the CPU). It
is built on a weight's first use and remembered by the weight's identity and
version counter, so an in-place update (an optimizer step) repacks it and a
freed weight drops its copy. Products that autograd must see (training) and
anything that is not a 2-D float32/bfloat16 CPU weight take ``F.linear``, and so
do bfloat16 weights on CPUs where oneDNN has no bfloat16 products.
``DSPARK_CPU_LINEAR=aten`` turns the packed path off for comparison.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch

# (weak reference to the weight, its version when packed, the packed copy), by id(weight)
_packed: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
_enabled_override: bool | None = None


@functools.cache
def onednn_available() -> bool:
    """True when this torch build has oneDNN and the two packed-linear operators."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available()) and ops is not None and \
            hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def bfloat16_packed_supported() -> bool:
    """True when oneDNN can run bfloat16 products on this CPU. Without AVX512 (BW/VL/DQ) or AVX-NE-CONVERT
    its packed bfloat16 operator raises instead of emulating, so bfloat16 weights then take ``F.linear``."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private; absent or changed: assume no
        return False


def set_enabled(enabled: bool | None) -> None:
    """Force the packed path on/off (``None``: follow ``DSPARK_CPU_LINEAR``); for benchmarks and tests."""
    global _enabled_override
    _enabled_override = enabled


def enabled() -> bool:
    """Whether CPU products may take the packed path at all."""
    if _enabled_override is not None:
        return _enabled_override and onednn_available()
    return os.environ.get("DSPARK_CPU_LINEAR", "onednn") != "aten" and onednn_available()


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # inference-mode tensors keep no version counter (and cannot change outside it)
        return 0


def packed(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN copy of ``weight`` ([out, in]), built on first use and after any in-place change."""
    key = id(weight)
    entry = _packed.get(key)
    version = _version(weight)
    if entry is not None and entry[0]() is weight and entry[1] == version:
        return entry[2]
    copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    _packed[key] = (weakref.ref(weight, lambda _ref, key=key: _packed.pop(key, None)), version, copy)
    return copy


def takes_packed_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True when ``x @ weight.T + bias`` can run on a packed weight (CPU, inference, 2-D weight,
    float32, or bfloat16 where oneDNN supports it; one dtype throughout)."""
    return (weight.device.type == "cpu" and x.device.type == "cpu" and weight.dim() == 2
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bfloat16_packed_supported()))
            and x.dtype == weight.dtype
            and (bias is None or bias.dtype == weight.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and enabled())


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the packed weight; call only where :func:`takes_packed_path` holds."""
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "none", [None], "")
