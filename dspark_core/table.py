"""Cost tables: fit, save, load and check one against a launch.

This is the entry point the calibration stage, the engine and the ``table``
commands use. The types live in :mod:`dspark_core.costs.bundle`, the JSON
forms in :mod:`dspark_core.costs.formats`; see ``docs/cost-tables.md``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from dspark_core.costs.base import CostSample, pool_samples
from dspark_core.costs.bundle import CostTable, IntervalFit, Provenance
from dspark_core.costs.fingerprint import Fingerprint, compare
from dspark_core.costs.formats import (
    CostModelLookup,
    render_json,
    resolve_cost_model,
    table_from_json,
    table_to_json,
)
from dspark_core.errors import ConfigError, TableError
from dspark_core.fit_settings import CalibrationSettings, ContextInterval

__all__ = [
    "CostTable", "IntervalFit", "Provenance", "check_compatible", "check_output_path", "default_lookup",
    "dumps_table", "fit_table", "load_table", "loads_table", "save_table",
]


def default_lookup() -> CostModelLookup:
    """Cost-model lookup through the process-wide hooks (entry-point plugins only)."""
    from dspark_core.plugins import default_hooks  # late: keeps this module import-light

    return default_hooks().cost_model


def _context_of(sample: CostSample, contexts: Sequence[ContextInterval]) -> int:
    if isinstance(sample.context, ContextInterval):
        if sample.context not in contexts:
            raise ConfigError(f"a sample names context {sample.context.describe()}, which the settings do not list")
        return contexts.index(sample.context)
    if not 0 <= sample.context < len(contexts):
        raise ConfigError(f"a sample names context index {sample.context}; the settings list {len(contexts)} interval(s)")
    return sample.context


def fit_table(
    settings: CalibrationSettings,
    samples: Sequence[CostSample],
    lookup: CostModelLookup,
    fingerprint: Fingerprint | None = None,
    provenance: Provenance | None = None,
) -> CostTable:
    """Fit ``settings.model`` once per context interval and build the table.

    With a ``fingerprint`` the result is a bundle (provenance defaults to now);
    without one it is a bare table, which needs exactly one interval.
    Raises ConfigError naming the interval whose samples cannot be fitted.
    """
    model = resolve_cost_model(settings.model, lookup)
    grouped: dict[int, list[CostSample]] = defaultdict(list)
    for sample in samples:
        grouped[_context_of(sample, settings.contexts)].append(sample)
    fits = []
    for index, context in enumerate(settings.contexts):
        label = f"contexts[{index}] {context.describe()}"
        if not grouped[index]:
            raise ConfigError(f"{label}: no calibration samples")
        try:
            cost = model.fit(grouped[index], settings.draft_width)
        except ConfigError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        fits.append(IntervalFit(context, cost, pool_samples(grouped[index])))
    if fingerprint is None:
        if len(fits) != 1:
            raise ConfigError("a bare table (no fingerprint) holds one context interval")
        return CostTable(settings.draft_width, settings.model, [IntervalFit(None, fits[0].cost)])
    return CostTable(settings.draft_width, settings.model, fits, settings, fingerprint, provenance or Provenance.now())


def check_output_path(path: str | Path) -> Path:
    """Refuse an existing output file or a missing directory; call before any work."""
    p = Path(path)
    if p.exists():
        raise TableError(f"cost table output {p} already exists; choose a new file (tables are never overwritten)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise TableError(f"cost table output directory {parent} does not exist; create it before launch")
    if not os.access(parent, os.W_OK):
        raise TableError(f"cost table output directory {parent} is not writable")
    return p


def dumps_table(table: CostTable) -> str:
    """The exact text :func:`save_table` writes (newline-terminated)."""
    try:
        return render_json(table_to_json(table)) + "\n"
    except ValueError as exc:  # NaN or infinity in a fit
        raise TableError(f"cannot save a table with non-finite numbers: {exc}") from None


def save_table(table: CostTable, path: str | Path) -> Path:
    """Write ``table`` atomically: a temporary file in the same directory, then a rename.

    Readers never see a half-written table, and an existing file is never replaced.
    """
    p = check_output_path(path)
    text = dumps_table(table)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent if str(p.parent) else ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, p)  # atomic and fails if someone created the file meanwhile
        except FileExistsError:
            raise TableError(f"cost table output {p} appeared while saving; not overwritten") from None
        except OSError:  # file systems without hard links
            os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return p


def loads_table(text: str, lookup: CostModelLookup, source: str = "<string>") -> CostTable:
    """Parse a table from JSON text (any accepted format)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TableError(
            f"{source}: not valid JSON, the file may be truncated or corrupt (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    return table_from_json(data, lookup, source)


def load_table(path: str | Path, lookup: CostModelLookup | None = None) -> CostTable:
    """Read and strictly validate a table file; ``lookup`` defaults to :func:`default_lookup`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TableError(f"cost table {p} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TableError(f"cannot read cost table {p}: {exc}") from None
    return loads_table(text, lookup or default_lookup(), str(p))


def check_compatible(table: CostTable, expected: Fingerprint | None, draft_width: int) -> str | None:
    """Check ``table`` against a launch; raise TableError listing EVERY mismatching field.

    The draft width is always checked (Draft5 and Draft7 costs are never mixed).
    Returns None after a full check, or a note for the startup audit when only
    the width could be checked (bare and legacy tables, or no ``expected``).
    """
    lines = []
    if table.draft_width != draft_width:
        lines.append(f"draft_width: saved {table.draft_width}, launch {draft_width}")
    if table.fingerprint is not None and expected is not None:
        lines += [m.describe() for m in compare(table.fingerprint, expected)]
    if lines:
        raise TableError(
            f"cost table {table.source} does not match this launch ({len(lines)} field(s) differ):\n  " + "\n  ".join(lines)
        )
    if table.fingerprint is None:
        return table.audit_note()
    if expected is None:
        return f"cost table {table.source}: no launch fingerprint given, only its draft width was checked"
    return None
