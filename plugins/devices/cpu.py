"""The CPU device: always available; float32, static graphs, gloo for multi-rank."""

from __future__ import annotations

import os
from typing import Any

from attrs import frozen

from dspark_core.audit import get_logger
from dspark_core.components import Component
from dspark_core.device import DeviceSpec
from dspark_core.hookspecs import hookimpl


@frozen
class CpuDevice(DeviceSpec):
    """The CPU spec; at launch it applies ``--cpu_threads`` (:func:`launch_cpu_threads`) and warns when
    bfloat16 is asked of a CPU that can only emulate it."""

    def prepare_launch(self, config: Any) -> None:
        threads = launch_cpu_threads(config)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        asked = {flag: value for flag, value in (("dtype", config.dtype), ("draft_dtype", config.draft_dtype))
                 if value == "bfloat16"}
        if asked and not native_bfloat16():
            # it runs (through F.linear), but slower than float32: say so once, at startup
            get_logger("cpu").warning(
                "bfloat16 asked on a CPU without native bfloat16 products: they are emulated and run slower "
                "than float32; drop the flag (auto) to keep float32", **asked)


    def intra_op_threads(self, config: Any) -> int:
        """The count a launch of ``config`` runs at: its ``--cpu_threads``, or the process's own for auto."""
        import torch

        threads = launch_cpu_threads(config)
        return torch.get_num_threads() if threads is None else threads

def launch_cpu_threads(config: Any) -> int | None:
    """The intra-op thread count ``--cpu_threads`` asks for (None: keep the process's own, PyTorch's default).

    ``0`` (auto) keeps PyTorch's default, every core, for a one-rank launch. Ranks of a multi-rank
    launch on the CPU usually share one host, where a full-width thread pool per rank would
    oversubscribe its cores (threads spin at every barrier), so each of them gets one thread.
    """
    if config.cpu_threads > 0:
        return int(config.cpu_threads)
    return 1 if config.nnodes > 1 else None


def native_bfloat16() -> bool:
    """True when this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): there a bfloat16 draft
    reads half the bytes at full speed. Elsewhere bfloat16 products are emulated and slower."""
    import torch

    try:
        capability = torch._C._cpu._get_cpu_capability()  # private; absent or changed: assume no
    except (AttributeError, RuntimeError):
        return False
    return bool(capability.get("avx512_bf16") or capability.get("amx_bf16"))


@hookimpl
def dspark_components() -> list[Component]:
    # lowest priority: --device=auto falls back to the CPU when no accelerator is usable
    return [Component("device", "cpu", "host CPU via PyTorch", auto_priority=0)]


@hookimpl
def dspark_device(name: str) -> DeviceSpec | None:
    if name != "cpu":
        return None
    return CpuDevice(
        name="cpu",
        torch_device="cpu",
        # float32, though bfloat16 is exact too (batch-invariant forwards) and 1.4-1.5x faster where
        # it is native: it is numerically another model, and the default SmolLM2 checkpoint answered
        # "What is the capital of France?" with "L'Étoile, la Marseillaise" in bfloat16 (float32:
        # "The capital of France is Paris."); --dtype=bfloat16 asks for it (benchmarks/results/amx)
        default_dtype="float32",
        default_graph_backend="static",
        distributed_backend="gloo",
        description=f"{os.cpu_count()} logical cores",
        # measured on the shipped SmolLM2 draft (AVX512-BF16): proposals 1.34-1.51x faster, held-out
        # acceptance unchanged (tau 1.762 against 1.759 over 48 prompts); docs/models.md
        default_draft_dtype="bfloat16" if native_bfloat16() else None,
        # a proposal's rows cost compute here like verify rows do, and the larger a bucket, the fewer
        # drafted tokens per request a step verifies: 4 tokens from 4 requests on, 2 from 16 on. On the
        # 2-core AVX2 CPU, 16 requests: a proposal 16.6 -> 8.5 ms, fixed k1 1.053x -> 1.096x and adaptive
        # 1.035x -> 1.057x of target-only in lock-step on MT-Bench (docs/architecture.md, "Draft depth")
        default_draft_depths=((4, 4), (16, 2)),
    )
