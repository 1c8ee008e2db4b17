"""Configuration files shipped inside the package, so they work from any directory.

``--adaptive_dspark_calibration=demo`` names the demo calibration file for the
draft width: ``demo-calibration.json`` (K=7, the one ``make serve`` uses) or
``demo-calibration-k5.json`` (K=5). docs/calibration.md describes them.
(``configs/`` at the repository root links to these files.)

The demo grid names request buckets 1 to 16. A launch that captures fewer
(``--max_seqs_per_batch`` below 16) probes the demo's points of the buckets it
does capture (:func:`fit_demo_to_buckets`); a file given by path is never
changed, so there an uncaptured bucket stays an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from dspark_core.errors import ConfigError
from dspark_core.fit_settings import rows_by_bucket

if TYPE_CHECKING:
    from dspark_core.calibration.plan import CalibrationFile

CONFIGS_DIR = Path(__file__).resolve().parent
DEMO = "demo"
DEMO_CALIBRATIONS = {7: "demo-calibration.json", 5: "demo-calibration-k5.json"}


def demo_calibration_path(width: int) -> Path:
    """The shipped demo calibration file for draft width ``width``."""
    name = DEMO_CALIBRATIONS.get(width)
    if name is None:
        widths = " and ".join(f"K={k}" for k in sorted(DEMO_CALIBRATIONS))
        raise ConfigError(f"--adaptive_dspark_calibration=demo: the demo calibration ships for {widths} only, "
                          f"got --num_speculative_tokens={width}; pass a calibration file instead")
    path = CONFIGS_DIR / name
    if not path.is_file():
        raise ConfigError(f"--adaptive_dspark_calibration=demo: {path} is missing from the installation")
    return path


def resolve_calibration(value: str, width: int) -> str:
    """``demo`` -> the shipped file for ``width``; anything else is a path, returned as given."""
    return str(demo_calibration_path(width)) if value == DEMO else value


def fit_demo_to_buckets(demo: CalibrationFile, captured: Sequence[int]) -> CalibrationFile:
    """The demo grid restricted to the ``captured`` request buckets (its rows per bucket kept as written)."""
    keep = set(captured)
    buckets = None if demo.request_buckets is None else tuple(b for b in demo.request_buckets if b in keep)
    per_bucket = rows_by_bucket(demo.target_graph_rows)
    rows = demo.target_graph_rows if per_bucket is None else {b: r for b, r in per_bucket.items() if b in keep}
    if buckets == ():
        raise ConfigError(f"--adaptive_dspark_calibration=demo: the demo grid has no point in the captured request "
                          f"buckets {sorted(keep)}; pass a calibration file instead")
    return attrs.evolve(demo, request_buckets=buckets, target_graph_rows=rows)
