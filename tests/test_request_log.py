"""The access log: one structured ``request`` event per ended request, and none when it is turned off."""

from __future__ import annotations

import httpx
from structlog.testing import capture_logs

from dspark_core.server import AsyncEngineService, BackgroundServer, build_app
from dspark_core.server.testing import tiny_engine

ENGINE = dict(seed=5, buckets=(1, 2), max_model_len=128, eos=False)
GOOD = {"prompt": "keep going", "temperature": 0, "max_tokens": 6}


def served_requests(log_requests: bool) -> list[dict]:
    with capture_logs() as logs:
        service = AsyncEngineService(tiny_engine(**ENGINE), max_pending=4)
        with BackgroundServer(build_app(service, model_name="tiny", log_requests=log_requests)) as server:
            service.mark_ready()
            plain = httpx.post(server.url + "/v1/completions", json=GOOD, timeout=30,
                               headers={"X-Request-Id": "client-trace-7"})
            assert plain.status_code == 200
            streamed = httpx.post(server.url + "/v1/completions", json={**GOOD, "stream": True}, timeout=30)
            assert streamed.status_code == 200 and "[DONE]" in streamed.text
            # X-Request-Id: the client's own echoed, else the response's id (streamed or not)
            assert plain.headers["x-request-id"] == "client-trace-7"
            assert streamed.headers["x-request-id"].startswith("cmpl-") and streamed.headers["x-request-id"] in streamed.text
            refused = httpx.post(server.url + "/v1/completions", json={**GOOD, "n": 3}, timeout=30,
                                 headers={"X-Request-Id": "refused-1"})
            assert refused.status_code == 400 and refused.headers["x-request-id"] == "refused-1"
    events = [event for event in logs if event["event"] == "request"]
    if events:
        assert events[0]["id"] == plain.json()["id"]  # the id the client saw
    return events


def test_each_ended_request_is_logged_once_with_what_is_known_of_it():
    plain, streamed, refused = served_requests(log_requests=True)
    for event in (plain, streamed):
        assert event["status"] == 200 and event["endpoint"] == "completions" and event["log_level"] == "info"
        assert event["completion_tokens"] == 6 and event["finish_reason"] == "length"
        assert event["prompt_tokens"] > 0 and event["steps"] >= 1 and event["accepted_length"] >= 1
        assert 0 < event["ttft_seconds"] <= event["seconds"]
    assert (plain["stream"], streamed["stream"]) == (False, True)
    assert plain["client_request_id"] == "client-trace-7" and "client_request_id" not in streamed
    assert streamed["id"].startswith("cmpl-") and streamed["id"] != plain["id"]
    assert refused["status"] == 400 and refused["error_code"] == "unsupported_value" and "n:" in refused["error"]
    assert refused["client_request_id"] == "refused-1"
    assert "prompt_tokens" not in refused  # refused before admission: nothing else is known


def test_the_access_log_can_be_turned_off():
    assert served_requests(log_requests=False) == []
