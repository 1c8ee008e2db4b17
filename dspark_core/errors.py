"""Exception types users see. Each message names the field, path or value at fault."""

from __future__ import annotations


class DSparkError(Exception):
    """Base class for every error dspark-core raises on purpose."""


class ConfigError(DSparkError):
    """A flag, configuration file or combination of settings is invalid."""


class PluginError(DSparkError):
    """A plugin could not be loaded, is blocked, or no plugin provides a name."""


class TableError(DSparkError):
    """A cost table is malformed or incompatible with this launch."""


class StartupAborted(DSparkError):
    """Warmup or calibration stopped early because the server is shutting down."""


class ModelError(DSparkError):
    """A checkpoint or model file is missing, malformed or unsupported."""
