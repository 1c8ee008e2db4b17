"""Configuration files shipped inside the package, so they work from any directory.

``--adaptive_dspark_calibration=demo`` names the demo calibration file for the
draft width: ``demo-calibration.json`` (K=7, the one ``make serve`` uses) or
``demo-calibration-k5.json`` (K=5). docs/calibration.md describes them.
(``configs/`` at the repository root links to these files.)
"""

from __future__ import annotations

from pathlib import Path

from dspark_core.errors import ConfigError

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
