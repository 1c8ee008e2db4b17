"""Structured logging, configured once per process.

Console rendering on a TTY, one JSON object per line otherwise (log shippers
and tests read those). Each unit of work emits one rich event; the startup
audit ("DSpark adaptive effective configuration") is the main one.

Libraries that log through the standard :mod:`logging` module (uvicorn, and the
server's own ``logging.getLogger(__name__)`` calls) are bridged into the same
pipeline by :func:`bridge_stdlib_logging`, so a served process writes every
line in one format.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import structlog

STARTUP_AUDIT_EVENT = "DSpark adaptive effective configuration"

_configured = False


class _StderrLogger:
    """Writes each event to whatever ``sys.stderr`` is at that moment.

    structlog's PrintLogger keeps the stream it was created with; when that
    stream is later replaced and closed (test capture, daemonising), logging
    would fail, so the stream is looked up per message instead.
    """

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


def _stderr_logger(*_args: Any) -> _StderrLogger:
    return _StderrLogger()


def configure_logging(*, json_output: bool | None = None, level: int = logging.INFO) -> None:
    """Configure structlog once; later calls are no-ops unless ``json_output`` is given."""
    global _configured
    # Respect a configuration made elsewhere (an embedding application, structlog's
    # capture_logs in tests) unless the caller asks for a specific renderer.
    if json_output is None and (_configured or structlog.is_configured()):
        return
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer(sort_keys=True) if json_output else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str = "dspark_core") -> Any:
    """A structlog logger bound to ``component=name``."""
    configure_logging()
    return structlog.get_logger().bind(component=name)


def _method_for(levelno: int) -> str:
    # stdlib levels onto structlog's methods (uvicorn's TRACE, 5, counts as debug)
    for floor, method in ((logging.CRITICAL, "critical"), (logging.ERROR, "error"), (logging.WARNING, "warning"),
                          (logging.INFO, "info")):
        if levelno >= floor:
            return method
    return "debug"


class StructlogHandler(logging.Handler):
    """A :mod:`logging` handler that re-emits each record through structlog.

    The record's logger name becomes ``component``, its formatted message the
    ``event``, and an attached exception the ``exception`` text; the configured
    structlog processors then add the level and timestamp and render the line,
    exactly as for a structlog call.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {"component": record.name}
            if record.exc_info:
                fields["exception"] = logging.Formatter().formatException(record.exc_info)
            getattr(structlog.get_logger(), _method_for(record.levelno))(record.getMessage(), **fields)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


#: stdlib logger trees a served process bridges: uvicorn's and the server modules'.
BRIDGED_LOGGERS = ("uvicorn", "dspark_core")


def bridge_stdlib_logging(names: tuple[str, ...] = BRIDGED_LOGGERS) -> None:
    """Send the stdlib loggers ``names`` (and their children) through structlog; idempotent.

    They stop propagating to the root logger, so an application's own root
    handler does not print the same line a second time in another format.
    Pass ``log_config=None`` to uvicorn, or its own handlers print too.
    """
    configure_logging()
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(h, StructlogHandler) for h in logger.handlers):
            logger.addHandler(StructlogHandler())
        logger.propagate = False


def emit_startup_audit(source: str, settings: Mapping[str, Any], geometry: Mapping[str, Any], **extra: Any) -> None:
    """Log the one startup audit event.

    ``source`` is ``defaults``, ``file`` or ``saved table``; ``settings`` must
    hold every effective setting including defaults the user did not write;
    ``geometry`` is the actually captured geometry.
    """
    if source not in ("defaults", "file", "saved table"):
        raise ValueError(f"audit source must be defaults, file or saved table, got {source!r}")
    get_logger("startup").info(STARTUP_AUDIT_EVENT, source=source, settings=dict(settings), geometry=dict(geometry), **extra)
