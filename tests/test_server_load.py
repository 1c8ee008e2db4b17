"""Overload (fast 429s, no accepted request lost or duplicated), client disconnects free their
slots, graceful shutdown drains in-flight requests, and an engine failure fails requests cleanly."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from dspark_core.engine.request import SamplingParams
from dspark_core.server import AsyncEngineService, BackgroundServer, build_app
from dspark_core.server.testing import tiny_engine

ENGINE = dict(seed=7, buckets=(1, 2), max_model_len=256, eos=False)


def engine_state(service):
    """(free slots, scheduler idle, device jobs in flight), read on the engine thread."""
    return service.call(lambda e: (e.storage.free_slots, e.scheduler.idle, len(e.queue.in_flight))).result(10)


def wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture()
def served():
    service = AsyncEngineService(tiny_engine(**ENGINE), max_pending=4)
    app = build_app(service, model_name="tiny")
    with BackgroundServer(app) as srv:
        service.mark_ready()
        yield srv, service, app


def test_overload_gets_429_and_loses_nothing(served):
    srv, service, app = served
    prompts = [f"request number {i}" for i in range(24)]
    engine = tiny_engine(**ENGINE)
    expected = engine.generate(prompts, SamplingParams(max_tokens=30))
    engine.close()

    async def burst():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            async def one(prompt):
                start = time.monotonic()
                r = await client.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 30,
                                                               "return_token_ids": True})
                return r, time.monotonic() - start
            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(burst())
    ok = [(i, r) for i, (r, _) in enumerate(results) if r.status_code == 200]
    refused = [(r, dt) for r, dt in results if r.status_code == 429]
    assert len(ok) + len(refused) == len(prompts)
    assert refused and len(ok) >= 4
    for r, dt in refused:
        error = r.json()["error"]
        assert "overloaded" in error["message"] and "limit 4" in error["message"]
        assert error["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
        assert dt < 5.0  # refused at admission, not after waiting for a slot
    ids = [r.json()["id"] for _, r in ok]
    assert len(set(ids)) == len(ids)
    for i, r in ok:  # every accepted request completed once, with its own exact output
        assert r.json()["dspark"]["token_ids"] == list(expected[i].token_ids)
    finished = app.state.metrics.finished.labels("length")._value.get()
    assert finished == len(ok)
    assert service.pending == 0
    assert engine_state(service) == (2, True, 0)
    # after the burst the server serves normally again
    again = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "temperature": 0, "max_tokens": 3})
    assert again.status_code == 200


def test_stream_disconnect_frees_the_slot(served):
    srv, service, app = served
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "long", "temperature": 0, "max_tokens": 230,
                                                             "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            assert service.pending == 1
        # leaving the block closes the connection mid-stream
    wait_until(lambda: service.pending == 0)
    assert engine_state(service) == (2, True, 0)
    closed = app.state.metrics.requests.labels("completions", "499")._value.get()
    assert closed == 1
    assert app.state.metrics.finished.labels("length")._value.get() == 0  # it never ran to the end


def test_non_streamed_disconnect_cancels(served):
    srv, service, app = served
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json={"prompt": "long", "temperature": 0, "max_tokens": 230},
                   timeout=httpx.Timeout(30, read=0.15))
    wait_until(lambda: service.pending == 0)
    assert engine_state(service) == (2, True, 0)
    assert app.state.metrics.requests.labels("completions", "499")._value.get() == 1


def test_graceful_shutdown_drains_in_flight():
    service = AsyncEngineService(tiny_engine(**ENGINE), max_pending=8)
    srv = BackgroundServer(build_app(service, model_name="tiny")).start()
    service.mark_ready()
    results = []

    def client(i):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": f"p{i}", "temperature": 0, "max_tokens": 120},
                       timeout=60)
        results.append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: service.pending == 4)  # all four admitted and decoding
    srv.stop()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in results)
    assert not srv.thread.is_alive() and not service._thread.is_alive()
    assert not service.ready


def test_engine_failure_fails_requests_cleanly(served):
    srv, service, app = served

    def explode():
        raise RuntimeError("device lost")

    service.call(lambda e: setattr(e, "step", explode)).result(10)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "temperature": 0, "max_tokens": 5}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 500 and error["code"] == "engine_failed" and "RuntimeError" in error["message"]
    assert "device lost" not in error["message"]  # the exception's text stays in the server log
    wait_until(lambda: service.failure is not None)
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and "device lost" not in health.text
    assert httpx.get(srv.url + "/ready").status_code == 503
    after = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "temperature": 0, "max_tokens": 5})
    assert after.status_code == 503 and "engine" in after.json()["error"]["message"]
