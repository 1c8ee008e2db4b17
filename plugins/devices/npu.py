"""Ascend NPUs through torch_npu (optional extra ``dspark-core[npu]``).

torch_npu is imported only when the NPU is selected, never at plugin import,
so hosts without it load this plugin fine and get one clear error if they ask
for the NPU.

``HCCL_OP_EXPANSION_MODE`` (the spec's launch sets ``AIV``) is read by HCCL
itself from the process environment: this plugin never sets or changes it, it
only reports the value it finds in the startup log (and warns about a value
HCCL does not document) so an operator can see what the ranks ran with.
"""

from __future__ import annotations

import os
from typing import Any

from attrs import frozen

from dspark_core.audit import get_logger
from dspark_core.components import Component
from dspark_core.device import DeviceSpec, import_runtime
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl

#: The environment variable HCCL reads to choose where collective ops are expanded.
HCCL_EXPANSION_ENV = "HCCL_OP_EXPANSION_MODE"
#: Values CANN documents for it.
HCCL_EXPANSION_MODES = ("AIV", "AI_CPU", "HOST")
#: ``--npu_kernel_backend`` values: ``TORCH`` = plain torch ops that torch_npu implements.
NPU_KERNEL_BACKENDS = ("TORCH",)


def import_torch_npu() -> object:
    """Import torch_npu or raise a ConfigError that says how to get it."""
    return import_runtime("torch_npu", needed_for="device=npu", hint="install dspark-core[npu] on an Ascend host")


def hccl_op_expansion_mode(environ: os._Environ | dict | None = None) -> str | None:
    """The value of ``HCCL_OP_EXPANSION_MODE`` as the process sees it (None when unset)."""
    value = (os.environ if environ is None else environ).get(HCCL_EXPANSION_ENV)
    return value or None


def check_npu_kernel_backend(name: str) -> str:
    """Validate ``--npu_kernel_backend``; returns the canonical name."""
    canonical = str(name).upper()
    if canonical not in NPU_KERNEL_BACKENDS:
        raise ConfigError(f"npu_kernel_backend={name}: supported values are {', '.join(NPU_KERNEL_BACKENDS)} "
                          "(plain torch ops run by torch_npu; no custom device kernels)")
    return canonical


def log_npu_environment(kernel_backend: str = "TORCH") -> dict[str, str]:
    """Log (structlog, component ``device.npu``) the settings an NPU run depends on; returns them."""
    mode = hccl_op_expansion_mode()
    fields = {"hccl_op_expansion_mode": mode or "<unset>", "npu_kernel_backend": check_npu_kernel_backend(kernel_backend)}
    log = get_logger("device.npu")
    log.info("npu environment", **fields)
    if mode is not None and mode not in HCCL_EXPANSION_MODES:
        log.warning("unrecognised HCCL_OP_EXPANSION_MODE; passed to HCCL unchanged", value=mode,
                    documented=list(HCCL_EXPANSION_MODES))
    return fields


@frozen
class NpuDevice(DeviceSpec):
    """The NPU spec; at launch it logs the environment with the configured kernel backend."""

    def prepare_launch(self, config: Any) -> None:
        log_npu_environment(config.npu_kernel_backend)


@hookimpl
def dspark_components() -> list[Component]:
    return [Component("device", "npu", "Ascend NPU via torch_npu (optional)", auto_priority=10)]


@hookimpl
def dspark_device(name: str) -> DeviceSpec | None:
    if name != "npu":
        return None
    torch_npu = import_torch_npu()
    npu = getattr(torch_npu, "npu", None)
    if npu is None or not npu.is_available():
        raise ConfigError("device=npu: torch_npu is installed but reports no available NPU")
    fields = log_npu_environment()
    return NpuDevice(
        name="npu",
        torch_device="npu",
        default_dtype="bfloat16",
        default_graph_backend="aclgraph",
        distributed_backend="hccl",
        description=f"{HCCL_EXPANSION_ENV}={fields['hccl_op_expansion_mode']}",
    )
