"""Configuration files shipped inside the package, so they work from any directory.

``--adaptive_dspark_calibration=demo`` names the demo calibration file for the
draft width: ``demo-calibration.json`` (K=7, the one ``make serve`` uses) or
``demo-calibration-k5.json`` (K=5). A bfloat16 or float16 launch gets their
``-bfloat16`` twins, which also probe the first tier of every 32-row stair of a
batch-invariant bfloat16 target. docs/calibration.md describes them.
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
# Half-precision targets multiply at most 32 rows at a time (batch-invariant products), so their
# step cost climbs in stairs that interpolation between sparse probes would price as a ramp; their
# demo grid probes the first tier of every stair. Float32 costs are smooth and keep the shorter grid
# (about 30 s less startup for `make serve`).
STAIR_DTYPES = ("bfloat16", "float16")


def demo_calibration_path(width: int, dtype: str = "float32") -> Path:
    """The shipped demo calibration file for draft width ``width`` and target dtype ``dtype``."""
    name = DEMO_CALIBRATIONS.get(width)
    if name is not None and dtype in STAIR_DTYPES:
        name = name.replace(".json", "-bfloat16.json")
    if name is None:
        widths = " and ".join(f"K={k}" for k in sorted(DEMO_CALIBRATIONS))
        raise ConfigError(f"--adaptive_dspark_calibration=demo: the demo calibration ships for {widths} only, "
                          f"got --num_speculative_tokens={width}; pass a calibration file instead")
    path = CONFIGS_DIR / name
    if not path.is_file():
        raise ConfigError(f"--adaptive_dspark_calibration=demo: {path} is missing from the installation")
    return path


def resolve_calibration(value: str, width: int, dtype: str = "float32") -> str:
    """``demo`` -> the shipped file for ``width`` and ``dtype``; anything else is a path, returned as given."""
    return str(demo_calibration_path(width, dtype)) if value == DEMO else value


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
