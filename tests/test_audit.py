"""The startup audit event and logging configuration."""

import json

import pytest
import structlog

from dspark_core.audit import STARTUP_AUDIT_EVENT, configure_logging, emit_startup_audit


def test_startup_audit_event_carries_source_settings_and_geometry(capsys):
    configure_logging(json_output=True)
    emit_startup_audit("defaults", {"model": "additive", "warmup_steps": 8}, {"draft_width": 7, "request_buckets": [1, 2]})
    line = capsys.readouterr().err.strip().splitlines()[-1]
    event = json.loads(line)
    assert event["event"] == STARTUP_AUDIT_EVENT
    assert event["source"] == "defaults"
    assert event["settings"]["warmup_steps"] == 8
    assert event["geometry"]["request_buckets"] == [1, 2]


def test_audit_source_is_checked():
    with pytest.raises(ValueError, match="defaults, file or saved table"):
        emit_startup_audit("guess", {}, {})


def test_audit_event_is_capturable_with_structlog_testing():
    with structlog.testing.capture_logs() as logs:
        emit_startup_audit("file", {"model": "sps"}, {"draft_width": 5})
    assert logs[-1]["event"] == STARTUP_AUDIT_EVENT and logs[-1]["source"] == "file"


def test_logging_follows_a_replaced_stderr(monkeypatch):
    import io
    import sys

    configure_logging(json_output=True)
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    emit_startup_audit("defaults", {}, {})
    first.close()  # e.g. a capture that ended
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    emit_startup_audit("file", {}, {})
    assert json.loads(second.getvalue().splitlines()[-1])["source"] == "file"
