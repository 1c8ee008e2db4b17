"""The compatibility fingerprint a cost table is saved with, and how launches are compared.

A saved table is only valid for a launch that runs the same checkpoints with
the same parallelism and execution settings, because each of them changes the
measured step time. The fingerprint records all of them; :func:`compare`
lists every field that differs so a user can fix them all in one go.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from attrs import frozen

from dspark_core.convert import unstructure
from dspark_core.errors import ConfigError
from dspark_core.geometry import Geometry

#: Bytes of a single-file checkpoint (GGUF) hashed as its "config": the header
#: and metadata live at the start of the file.
HEADER_BYTES = 1 << 20


@frozen
class ModelIdentity:
    """A checkpoint's identity: its file/directory name, config digest and total size."""

    name: str
    config_digest: str
    size_bytes: int


@frozen
class Parallelism:
    """How the service is split across ranks."""

    nnodes: int
    tp: int
    dp: int
    cp: int


@frozen
class Execution:
    """Execution settings that change step timing, including the captured geometry."""

    device: str
    graph_backend: str
    dtype: str
    schedule_overlap: bool
    task_pipeline: bool
    geometry: Geometry
    draft_dtype: str | None = None  # the draft's dtype where it differs from ``dtype`` (None: the same)
    # --batch_invariant where it is not ``auto`` (None: the target's own default; older tables carry None)
    batch_invariant: str | None = None
    # host intra-op threads on a CPU, which change every step's cost (1.5x at 16 requests on 2 cores);
    # None on other devices, and in tables saved before the count was recorded, which load at any count
    cpu_threads: int | None = None
    # (request bucket, tokens the draft proposes there) where fewer than K (--draft_depths), which
    # changes what a drafted step costs; None where every bucket proposes K (and in older tables)
    draft_depths: tuple[tuple[int, int], ...] | None = None


@frozen
class Fingerprint:
    """Everything a saved table must agree with before it can be reused."""

    target: ModelIdentity
    draft: ModelIdentity | None
    parallelism: Parallelism
    execution: Execution


@frozen
class Mismatch:
    """One differing field: dotted name, saved value and launch value (JSON-ish)."""

    field: str
    saved: Any
    launch: Any

    def describe(self) -> str:
        """``field: saved X, launch Y`` with JSON spelling of the values."""
        return f"{self.field}: saved {json.dumps(self.saved)}, launch {json.dumps(self.launch)}"


def identity_of(path: str | Path) -> ModelIdentity:
    """Identify a checkpoint without reading its weights.

    Directory: digest of ``config.json`` (or of every top-level ``*.json`` when
    there is none) and the total size of its files. Single file (GGUF): digest
    of its first :data:`HEADER_BYTES` bytes and its size.
    """
    p = Path(path)
    digest = hashlib.sha256()
    if p.is_dir():
        configs = [p / "config.json"] if (p / "config.json").is_file() else sorted(p.glob("*.json"))
        for config in configs:
            digest.update(config.name.encode() + b"\0" + config.read_bytes())
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    elif p.is_file():
        with p.open("rb") as fh:
            digest.update(fh.read(HEADER_BYTES))
        size = p.stat().st_size
    else:
        raise ConfigError(f"cannot fingerprint checkpoint {str(path)!r}: no such file or directory")
    return ModelIdentity(name=p.name, config_digest=f"sha256:{digest.hexdigest()}", size_bytes=size)


def tensor_parallel_size(config: Any) -> int:
    """The config's ``tp_size`` when it has one, else the ranks left after DP and CP."""
    explicit = getattr(config, "tp_size", None)
    if explicit:
        return int(explicit)
    per_replica = config.dp_size * config.cp_size
    return config.nnodes // per_replica if per_replica and config.nnodes % per_replica == 0 else config.nnodes


def launch_fingerprint(
    config: Any,
    geometry: Geometry,
    *,
    device: str | None = None,
    graph_backend: str | None = None,
    dtype: str | None = None,
    draft_dtype: str | None = None,
    target_path: str | Path | None = None,
    draft_path: str | Path | None = None,
    cpu_threads: int | None = None,
    draft_depths: dict[int, int] | None = None,
) -> Fingerprint:
    """Fingerprint of a launch described by a ``ServeConfig``.

    The engine passes the resolved device, graph backend, dtype and checkpoint
    paths (the config may say ``auto`` or an alias); each defaults to the
    config's own value.
    """
    target = target_path or config.model
    if not target:
        raise ConfigError("cannot fingerprint the launch: --model is not set")
    draft = draft_path or getattr(config, "draft_model", None)
    backend = graph_backend or (config.python_graph_backend if config.enable_graph else "disabled")
    return Fingerprint(
        target=identity_of(target),
        draft=identity_of(draft) if draft else None,
        parallelism=Parallelism(config.nnodes, tensor_parallel_size(config), config.dp_size, config.cp_size),
        execution=Execution(
            device=device or config.device,
            graph_backend=backend,
            dtype=dtype or config.dtype,
            schedule_overlap=config.enable_schedule_overlap,
            task_pipeline=config.enable_task_pipeline,
            geometry=geometry,
            draft_dtype=_draft_dtype(draft_dtype or getattr(config, "draft_dtype", None), dtype or config.dtype, draft),
            batch_invariant=_batch_invariant(getattr(config, "batch_invariant", "auto")),
            cpu_threads=cpu_threads,
            draft_depths=tuple(sorted(draft_depths.items())) if draft_depths else None,
        ),
    )


def _draft_dtype(draft_dtype: str | None, dtype: str, draft: Any) -> str | None:
    # recorded only where it differs: tables saved before drafts had their own dtype (and launches
    # whose draft computes in the target's dtype) carry None and stay compatible
    return draft_dtype if draft and draft_dtype not in (None, dtype) else None


def _batch_invariant(setting: str) -> str | None:
    # ``auto`` is recorded as None, so tables saved before the flag existed match an ``auto`` launch
    return None if setting == "auto" else setting


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else key, out)
    else:
        out[prefix] = value


def _plain(fp: Fingerprint) -> dict[str, Any]:
    # Round-trip through JSON so tuples and lists compare and print alike.
    return json.loads(json.dumps(unstructure(fp)))


def compare(saved: Fingerprint, launch: Fingerprint) -> list[Mismatch]:
    """Every field whose saved value differs from the launch's, in a stable order."""
    left: dict[str, Any] = {}
    right: dict[str, Any] = {}
    _flatten(_plain(saved), "", left)
    _flatten(_plain(launch), "", right)
    names = list(left) + [k for k in right if k not in left]
    return [Mismatch(k, left.get(k), right.get(k)) for k in names
            if left.get(k) != right.get(k) and not (k in UNRECORDED_MATCHES_ANY and left.get(k) is None)]


#: Keys that tables saved before they existed lack (None): such a table loads whatever the launch has.
UNRECORDED_MATCHES_ANY = frozenset({"execution.cpu_threads"})
