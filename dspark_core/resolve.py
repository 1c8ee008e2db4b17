"""What the serve flags mean on this host: the one place ``auto`` and the fingerprint are resolved.

``startup.resolve_launch`` (a real launch) and ``dspark-core table validate
--against`` (a launch described but not started) both go through these
functions, so a saved table is judged against exactly the fingerprint the
engine would record. Nothing here loads a model or allocates a tensor.
"""

from __future__ import annotations

from pathlib import Path

from dspark_core.config import ServeConfig
from dspark_core.costs.fingerprint import Fingerprint, launch_fingerprint
from dspark_core.device import DeviceSpec, resolve_draft_dtype, resolve_dtype
from dspark_core.errors import ConfigError
from dspark_core.geometry import Geometry, default_request_buckets
from dspark_core.plugins import Hooks

#: ``--python_graph_backend`` value recorded when ``--enable_graph`` is off.
GRAPHS_DISABLED = "disabled"


def pick_device(hooks: Hooks, name: str) -> DeviceSpec:
    """``auto``: the first usable device in the plugins' ``auto_priority`` order.

    With the default plugins: CUDA when usable, then an NPU when torch_npu is
    installed and sees one, else the CPU (whose error, if any, is raised).
    """
    if name != "auto":
        return hooks.device(name)
    candidates = hooks.auto_device_names()
    if not candidates:
        raise ConfigError("device=auto: no device plugin declares an auto_priority; name a device with --device")
    for candidate in candidates[:-1]:
        try:
            return hooks.device(candidate)
        except ConfigError:  # not usable here: try the next
            continue
    return hooks.device(candidates[-1])


def graph_backend_for(config: ServeConfig, device: DeviceSpec) -> str:
    """The graph backend a launch on ``device`` uses: ``disabled``, the device's default for ``auto``, or the name."""
    if not config.enable_graph:
        return GRAPHS_DISABLED
    name = config.python_graph_backend
    return device.default_graph_backend if name == "auto" else name


def captured_geometry(config: ServeConfig, draft_width: int | None = None) -> Geometry:
    """Draft width, request buckets and the target-row tiers ``--captured_target_rows`` asks to capture.

    ``draft_width`` defaults to the launch's: K, or 0 when speculation is off.
    """
    buckets = default_request_buckets(config.max_seqs_per_batch, config.acl_graph_decode_batch_size_limit)
    width = draft_width if draft_width is not None else (config.num_speculative_tokens if config.speculative else 0)
    capture = Geometry.bucket_multiples if config.captured_target_rows == "bucket_multiples" else Geometry.all_tiers
    return capture(width, buckets)


def fingerprint_for(
    config: ServeConfig,
    device: DeviceSpec | None,
    *,
    geometry: Geometry | None = None,
    dtype: str | None = None,
    draft_dtype: str | None = None,
    target_path: str | Path | None = None,
    draft_path: str | Path | None = None,
) -> Fingerprint:
    """The fingerprint a launch of ``config`` on ``device`` records in (and checks against) a cost table.

    ``geometry`` defaults to :func:`captured_geometry` at width K (only an
    adaptive, hence speculative, launch records a fingerprint, so flags given
    for checking a table keep their K even with speculation off), ``dtype`` to the
    device's resolution of ``--dtype`` (a caller may override it, as the
    multi-rank tests do with float64), ``draft_dtype`` to the device's resolution of
    ``--draft_dtype`` (recorded only where it differs from ``dtype``). ``device`` is None when the named device
    cannot be used on this host (``table validate`` on another machine): the
    flags' own values are recorded then.
    """
    backend = graph_backend_for(config, device) if device is not None else None
    if dtype is None and device is not None:
        dtype = resolve_dtype(config.dtype, device)
    if draft_dtype is None and device is not None and dtype is not None:
        draft_dtype = resolve_draft_dtype(config.draft_dtype, device, dtype)
    return launch_fingerprint(
        config, geometry if geometry is not None else captured_geometry(config, config.num_speculative_tokens),
        device=device.name if device is not None else None, graph_backend=backend, dtype=dtype, draft_dtype=draft_dtype,
        target_path=target_path, draft_path=draft_path,
        cpu_threads=_intra_op_threads(device, config))


def _intra_op_threads(device: DeviceSpec | None, config: ServeConfig) -> int | None:
    # a device object from before the method existed (or a stand-in) prices no host threads
    method = getattr(device, "intra_op_threads", None)
    return None if method is None else method(config)
