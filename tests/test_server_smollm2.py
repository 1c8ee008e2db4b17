"""One chat completion over HTTP on the real SmolLM2-135M-Instruct (with a random draft: the
verifier keeps the output exactly the target's greedy answer)."""

from __future__ import annotations

import httpx
import pytest

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.models.loading import load_target
from dspark_core.models.random_models import random_draft
from dspark_core.server import AsyncEngineService, BackgroundServer, build_app

pytestmark = pytest.mark.slow


def test_capital_of_france_over_http():
    target = load_target("smollm2")
    draft = random_draft(target.config, seed=0, block_size=7)
    engine = Engine(target, draft, EngineConfig(draft_width=7, policy="fixed", policy_options={"k": 2},
                                                request_buckets=(1, 2), max_model_len=512, schedule_overlap=True))
    service = AsyncEngineService(engine, max_pending=4)
    with BackgroundServer(build_app(service, model_name="smollm2")) as srv:
        assert httpx.get(srv.url + "/ready").status_code == 503
        service.mark_ready()
        response = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert response.status_code == 200, response.text
    data = response.json()
    assert "Paris" in data["choices"][0]["message"]["content"]
    assert data["usage"]["completion_tokens"] <= 16
    assert data["dspark"]["steps"] >= 1
