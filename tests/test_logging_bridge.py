"""stdlib logging (uvicorn's loggers, the server's own) comes out in structlog's one format."""

from __future__ import annotations

import json
import logging

import pytest
import structlog
from starlette.applications import Starlette

from dspark_core import audit
from dspark_core.audit import StructlogHandler, bridge_stdlib_logging, configure_logging, get_logger
from dspark_core.server.http import BackgroundServer


@pytest.fixture
def json_logging():
    """JSON rendering for the test, then the previous structlog configuration back."""
    saved, was_configured = structlog.get_config(), audit._configured
    configure_logging(json_output=True)
    bridge_stdlib_logging()
    uvicorn_error = logging.getLogger("uvicorn.error")
    level = uvicorn_error.level
    uvicorn_error.setLevel(logging.INFO)  # what uvicorn.Config(log_level="info") does
    yield
    uvicorn_error.setLevel(level)
    structlog.configure(**saved)
    audit._configured = was_configured


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_uvicorn_record_is_rendered_like_a_structlog_event(json_logging, capsys):
    get_logger("serve").info("serving", model="m")
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 4242)
    ours, theirs = _lines(capsys.readouterr().err)
    assert theirs == {"event": "Started server process [4242]", "component": "uvicorn.error", "level": "info",
                      "timestamp": theirs["timestamp"]}
    assert set(theirs) == set(ours) - {"model"}  # the same keys, rendered by the same processors
    assert theirs["timestamp"].endswith("Z") and ours["timestamp"].endswith("Z")


def test_levels_and_exceptions_of_stdlib_records(json_logging, capsys):
    log = logging.getLogger("dspark_core.server.app")
    try:
        raise ValueError("bad input")
    except ValueError as exc:
        log.error("unhandled error (reference %s) in %s", "abc", "/v1/x", exc_info=exc)
    logging.getLogger("uvicorn.error").warning("slow")
    logging.getLogger("uvicorn.error").debug("not shown at the default level")
    error, warning = _lines(capsys.readouterr().err)
    assert error["event"] == "unhandled error (reference abc) in /v1/x" and error["level"] == "error"
    assert error["component"] == "dspark_core.server.app"
    assert "ValueError: bad input" in error["exception"] and error["exception"].startswith("Traceback")
    assert (warning["event"], warning["level"]) == ("slow", "warning")


def test_bridging_is_idempotent_and_stops_propagation(json_logging):
    bridge_stdlib_logging()
    for name in ("uvicorn", "dspark_core"):
        logger = logging.getLogger(name)
        assert sum(isinstance(h, StructlogHandler) for h in logger.handlers) == 1 and not logger.propagate


def test_every_line_of_a_real_uvicorn_run_is_one_json_event(json_logging, capsys):
    app = Starlette()
    with BackgroundServer(app, log_level="info"):
        pass
    lines = _lines(capsys.readouterr().err)  # json.loads fails on uvicorn's own "INFO:     ..." format
    uvicorn_lines = [line for line in lines if line["component"].startswith("uvicorn")]
    assert any(line["event"].startswith("Started server process") for line in uvicorn_lines)
    assert any("Application startup complete" in line["event"] for line in uvicorn_lines)
    assert all({"event", "level", "timestamp", "component"} <= set(line) for line in lines)
