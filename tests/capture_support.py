"""CPU stand-ins for what graph capture on a device needs: a host-read recorder and a captured backend.

``host_reads()`` records every operation of the current thread that makes the
host wait for a device value: aten ops that read a scalar or produce a
data-dependent shape (``.item()``, ``int(t)``, ``nonzero``, boolean-mask
indexing, ...) seen through a ``TorchDispatchMode``, plus the Python-level
copies ``.tolist()``, ``.numpy()`` and ``.cpu()`` (on CPU tensors those never
reach the dispatcher, on a device each is a device-to-host copy). Each read is
reported with the innermost dspark_core / dspark_kernels / dspark_plugins
function that made it.

``device_ops_outside_replays()`` records the aten ops of the current thread
that run outside any replay of a :class:`StandInCapturedBackend` (what a step
still launches one by one from Python on a device), each with the project
functions on the stack when it ran.

``StandInCapturedBackend`` is a :class:`CapturedGraphBackend` whose device
graph API is replaced by no-ops: keys are "captured" in static-shape mode on
static input buffers, and a replay re-runs the recorded function in
static-shape mode into the captured output buffers, which is what replaying a
CUDA graph amounts to (same buffers, no Python shapes decided anew).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark_core.graphs import CapturedGraphBackend, GraphApi, static_shapes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark_core", "kernels", "plugins")

# aten ops whose result the host must wait for (a scalar read or a data-dependent output size)
SCALAR_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_static", "argwhere",
                "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
PYTHON_COPIES = ("tolist", "numpy", "cpu")

_active = threading.local()


@functools.lru_cache(maxsize=None)
def _project_path(filename: str) -> str | None:
    """A code file's path relative to the repository when it belongs to a project package, else None
    (cached: the recorders ask for every frame of every op, and resolving paths dominated their cost)."""
    path = Path(filename).resolve()
    if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
        return path.relative_to(ROOT).as_posix()
    return None


def _stack_project_frames(skip: int) -> list[str]:
    """``path:function`` of the project frames on the stack, innermost first, above the ``skip``
    innermost frames of the caller (the recorder's own)."""
    frames, frame = [], sys._getframe(skip + 1)
    while frame is not None:
        path = _project_path(frame.f_code.co_filename)
        if path is not None:
            frames.append(f"{path}:{frame.f_code.co_name}")
        frame = frame.f_back
    return frames


def _where() -> str:
    """``path:function`` of the innermost project frame below the recorder."""
    frames = _stack_project_frames(2)
    return frames[0] if frames else "<outside the project>"


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        read = name in SCALAR_READS
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            read = True  # sizes its output from the counts
        if name in INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            read = any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)
            name += "[bool mask]"
        if read:
            self.reads.append((name, _where()))
        return func(*args, **kwargs)


def _install_python_copy_hooks() -> None:
    if getattr(torch.Tensor, "_dspark_copy_hooks", False):
        return
    for method in PYTHON_COPIES:
        original = getattr(torch.Tensor, method)

        def hooked(self, *args, _original=original, _method=method, **kwargs):
            recorder = getattr(_active, "recorder", None)
            if recorder is not None:
                recorder.reads.append((_method, _where()))
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, method, hooked)
    torch.Tensor._dspark_copy_hooks = True


@contextlib.contextmanager
def host_reads():
    """Record this thread's host reads inside the block; yields the recorder (``.reads``)."""
    _install_python_copy_hooks()
    recorder = HostReads()
    _active.recorder = recorder
    try:
        with recorder:
            yield recorder
    finally:
        _active.recorder = None


def _project_frames() -> frozenset[str]:
    """``path:function`` of every project frame on the stack."""
    return frozenset(_stack_project_frames(2))


class _OutsideReplays(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, frozenset[str]]] = []  # (aten op, project frames on the stack)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(_active, "replaying", False):
            self.ops.append((func.overloadpacket.__name__, _project_frames()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def device_ops_outside_replays():
    """Record this thread's aten ops that run outside stand-in graph replays; yields the recorder (``.ops``)."""
    recorder = _OutsideReplays()
    with recorder:
        yield recorder


class _NoOp:
    def __init__(self, *args) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def wait_stream(self, other) -> None:
        pass


class StandInCapturedBackend(CapturedGraphBackend):
    """A captured backend on CPU: static buffers, static-shape capture, replay into the captured outputs."""

    name = "stand-in"

    def _graph_api(self) -> GraphApi:
        return GraphApi(_NoOp, _NoOp, _NoOp, _NoOp, _NoOp)

    def _replay(self, key, prepared):
        _active.replaying = True
        try:
            with static_shapes(key.kv_span):
                fresh = self._fns[key](**prepared.inputs)
            for out, new in zip(prepared.outputs, fresh, strict=True):
                out.copy_(new)
        finally:
            _active.replaying = False
        return prepared.outputs
