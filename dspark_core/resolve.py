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


def draft_depths_for(config: ServeConfig, device: DeviceSpec | None, geometry: Geometry) -> dict[int, int]:
    """``--draft_depths`` on this launch: request bucket -> tokens the draft proposes there, for the
    captured buckets that propose fewer than K (the rest propose all K).

    ``auto`` follows the device's ``default_draft_depths`` (the CPU's: fewer tokens at larger buckets,
    where a proposal's rows cost as much compute as verify rows; none for an unknown device), ``full``
    proposes K everywhere, and ``bucket:depth`` pairs name captured buckets and depths in 1..K.
    """
    value, width = config.draft_depths.strip(), geometry.draft_width
    if width == 0 or (value == "auto" and device is None):
        return {}
    if value == "auto":
        rule = sorted(getattr(device, "default_draft_depths", ()))
        depths = {}
        for bucket in geometry.request_buckets:
            steps = [depth for smallest, depth in rule if bucket >= smallest]
            if steps and steps[-1] < width:
                depths[bucket] = steps[-1]
        return depths
    return parse_draft_depths(value, geometry.request_buckets, width)


def parse_draft_depths(value: str, request_buckets: tuple[int, ...], width: int) -> dict[int, int]:
    """``full`` or ``bucket:depth`` pairs (``8:4,16:2``) -> the buckets that propose fewer than ``width``
    tokens; every bucket must be one of ``request_buckets`` and every depth lie in 1..width."""
    value = value.strip()
    if value == "full":
        return {}
    depths: dict[int, int] = {}
    for item in value.split(","):
        bucket_text, sep, depth_text = item.partition(":")
        try:
            bucket, depth = int(bucket_text), int(depth_text)
        except ValueError:
            bucket = depth = -1
        if not sep or bucket < 0:
            raise ConfigError(f"--draft_depths={value!r}: give auto, full or bucket:depth pairs such as 8:4,16:2 "
                              f"(could not read {item.strip()!r})")
        if bucket not in request_buckets:
            raise ConfigError(f"--draft_depths={value!r}: request bucket {bucket} is not captured "
                              f"(captured: {list(request_buckets)})")
        if not 1 <= depth <= width:
            raise ConfigError(f"--draft_depths={value!r}: depth {depth} for bucket {bucket} must lie in 1..{width} "
                              "(--num_speculative_tokens)")
        if bucket in depths:
            raise ConfigError(f"--draft_depths={value!r}: bucket {bucket} is given twice")
        depths[bucket] = depth
    return {bucket: depth for bucket, depth in depths.items() if depth < width}


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
    geometry = geometry if geometry is not None else captured_geometry(config, config.num_speculative_tokens)
    return launch_fingerprint(
        config, geometry, device=device.name if device is not None else None, graph_backend=backend, dtype=dtype,
        draft_dtype=draft_dtype, target_path=target_path, draft_path=draft_path,
        cpu_threads=_intra_op_threads(device, config), draft_depths=draft_depths_for(config, device, geometry))


def _intra_op_threads(device: DeviceSpec | None, config: ServeConfig) -> int | None:
    # a device object from before the method existed (or a stand-in) prices no host threads
    method = getattr(device, "intra_op_threads", None)
    return None if method is None else method(config)
