"""The immutable cost table: one fit per KV interval plus what it was fitted for.

A table is either a *bundle* (calibration settings, compatibility fingerprint
and provenance recorded; reusable after a full compatibility check) or *bare*
(one fit and its draft width only, e.g. converted from another engine's file;
only the width can be checked).
"""

from __future__ import annotations

import datetime as _dt
import socket
from collections.abc import Iterable
from typing import Any

from attrs import field, frozen

import dspark_core
from dspark_core.costs.base import Coverage, Measurement, measurement_tuple
from dspark_core.costs.fingerprint import Fingerprint
from dspark_core.errors import TableError
from dspark_core.fit_settings import CalibrationSettings, ContextInterval, check_contexts

#: Where a table came from; kept out of equality so a loaded table equals the saved one.
ORIGINS = ("fitted", "bundle", "bare", "legacy bare", "legacy sps", "legacy additive")


@frozen
class Provenance:
    """When, with which dspark-core and on which host a table was fitted."""

    created_utc: str
    dspark_core_version: str
    host: str

    @classmethod
    def now(cls) -> Provenance:
        """Provenance stamped with the current UTC time, this version and host name."""
        stamp = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        return cls(stamp, dspark_core.__version__, socket.gethostname())


@frozen
class IntervalFit:
    """A fitted cost for one KV interval (``context`` None: every KV length)."""

    context: ContextInterval | None
    cost: Any  # a FittedCost from the model's plugin
    measurements: tuple[Measurement, ...] = field(default=(), converter=measurement_tuple)

    @property
    def coverage(self) -> Coverage:
        """Buckets and rows the fit answers for."""
        return self.cost.coverage


def _fits(values: Iterable[IntervalFit]) -> tuple[IntervalFit, ...]:
    return tuple(values)  # a typed converter (see dspark_core.convert.int_tuple)


@frozen
class CostTable:
    """An immutable, installed-as-is cost table for one draft width."""

    draft_width: int
    model: str
    fits: tuple[IntervalFit, ...] = field(converter=_fits)
    settings: CalibrationSettings | None = None
    fingerprint: Fingerprint | None = None
    provenance: Provenance | None = None
    origin: str = field(default="fitted", eq=False)
    source: str = field(default="<memory>", eq=False)
    # True when the file had no draft_width and width 7 was assumed (legacy rule).
    width_assumed: bool = field(default=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.draft_width < 1:
            raise TableError(f"draft_width must be >= 1, got {self.draft_width}")
        if not self.fits:
            raise TableError("a cost table needs at least one fit")
        for fit in self.fits:
            if fit.cost.model != self.model or fit.cost.draft_width != self.draft_width:
                raise TableError(
                    f"fit of model {fit.cost.model!r} width {fit.cost.draft_width} in a {self.model!r} table of width {self.draft_width}"
                )
        if self.fingerprint is None:
            if self.settings is not None or self.provenance is not None or len(self.fits) != 1:
                raise TableError("a table without a fingerprint is bare: one fit, no settings, no provenance")
            return
        if self.settings is None or self.provenance is None:
            raise TableError("a bundle needs its calibration settings and provenance")
        self._check_bundle(self.settings, self.fingerprint)

    def _check_bundle(self, settings: CalibrationSettings, fingerprint: Fingerprint) -> None:
        if settings.draft_width != self.draft_width:
            raise TableError(f"calibration draft_width {settings.draft_width} differs from the table's {self.draft_width}")
        if fingerprint.execution.geometry.draft_width != self.draft_width:
            raise TableError(
                f"captured geometry draft_width {fingerprint.execution.geometry.draft_width} differs from the table's {self.draft_width}"
            )
        if settings.model != self.model:
            raise TableError(f"calibration model {settings.model!r} differs from the table's {self.model!r}")
        contexts = [f.context for f in self.fits if f.context is not None]
        if len(contexts) != len(self.fits):
            raise TableError("every fit of a bundle names its context interval")
        unknown = [c.describe() for c in contexts if c not in settings.contexts]
        if unknown:
            raise TableError(f"fits for context intervals {unknown} that the calibration settings do not list")
        try:
            check_contexts(contexts)
        except Exception as exc:  # ConfigError from the shared check; a table error here
            raise TableError(str(exc)) from None

    @property
    def is_bundle(self) -> bool:
        """True when the table carries a fingerprint (full compatibility check possible)."""
        return self.fingerprint is not None

    def fit_for(self, kv_length: int) -> IntervalFit | None:
        """The fit whose interval holds ``kv_length``; None when no interval does."""
        for fit in self.fits:
            if fit.context is None or fit.context.contains(kv_length):
                return fit
        return None

    def predict_seconds(self, request_bucket: int, target_rows: int, kv_length: int) -> float | None:
        """Full-step seconds; None when the KV length, bucket or rows are not covered.

        None tells the engine to use the prewarmed full-width path for that step.
        """
        fit = self.fit_for(kv_length)
        return None if fit is None else fit.cost.predict_seconds(request_bucket, target_rows)

    def audit_note(self) -> str | None:
        """A line for the startup audit when the check was partial; None for bundles."""
        if self.is_bundle:
            return None
        width = "no draft_width field, treated as 7" if self.width_assumed else f"draft_width {self.draft_width}"
        return (
            f"cost table {self.source} ({self.origin}, {width}) has no compatibility fingerprint: "
            "only its draft width could be checked against this launch"
        )
