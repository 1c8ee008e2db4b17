"""Old import path of the calibration settings types; they live in :mod:`dspark_core.fit_settings`.

The types moved below both ``calibration`` and ``costs`` (the cost-table
bundle records them too), so that ``costs`` never imports ``calibration``.
Everything that used to be importable from here still is.
"""

from __future__ import annotations

from dspark_core.convert import structure_checked
from dspark_core.fit_settings import (
    CalibrationSettings,
    ContextInterval,
    RowsByBucket,
    TargetRows,
    check_contexts,
    normalize_rows,
    settings_from_json,
    structure_rows,
    unstructure_rows,
)

# the former private names, for code that imported them
_normalize_rows = normalize_rows
_structure_rows = structure_rows
_unstructure_rows = unstructure_rows

__all__ = [
    "CalibrationSettings", "ContextInterval", "RowsByBucket", "TargetRows", "check_contexts", "normalize_rows",
    "settings_from_json", "structure_checked", "structure_rows", "unstructure_rows",
]
