"""Startup calibration: settings, probe plan and fitting of full-step costs."""

from dspark_core.calibration.settings import (
    CalibrationSettings,
    ContextInterval,
    check_contexts,
    settings_from_json,
)

__all__ = ["CalibrationSettings", "ContextInterval", "check_contexts", "settings_from_json"]
