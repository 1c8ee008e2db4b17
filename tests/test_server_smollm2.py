"""Chat completions over HTTP on the real SmolLM2-135M-Instruct with the shipped DSpark draft: what
the server returns (several requests at once) is the target-only greedy answer, token for token
(up to near-ties, see dspark_core/bench/exactness.py), and the draft's tokens were accepted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dspark_core.bench.exactness import compare, target_only
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.models.drafts import default_draft_path
from dspark_core.models.loading import load_target
from dspark_core.models.speculators_io import load_draft
from dspark_core.server import AsyncEngineService, BackgroundServer, build_app

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
             "Write a haiku about autumn."]


def test_served_output_is_target_greedy_over_http():
    target = load_target("smollm2")
    engine = Engine(target, load_draft(default_draft_path("smollm2")),
                    EngineConfig(draft_width=7, policy="fixed", policy_options={"k": 2}, request_buckets=(1, 2, 4),
                                 max_model_len=512, schedule_overlap=True))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [engine.encode(c) for c in chats]
    references = [target_only(target, p, MAX_TOKENS) for p in prompts]  # stops at EOS like the server
    service = AsyncEngineService(engine, max_pending=8)
    with BackgroundServer(build_app(service, model_name="smollm2")) as srv:
        assert httpx.get(srv.url + "/ready").status_code == 503
        service.mark_ready()

        def ask(messages):
            return httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
                "model": "smollm2", "temperature": 0, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                "messages": messages})

        with ThreadPoolExecutor(len(chats)) as pool:  # all at once: the engine batches them
            responses = list(pool.map(ask, chats))
    for response in responses:
        assert response.status_code == 200, response.text
    data = [r.json() for r in responses]
    served = [d["dspark"]["token_ids"] for d in data]
    result = compare(target, prompts, references, served)
    assert result["real"] == 0, result["divergences"]
    assert result["identical"] + result["near_tie"] == len(prompts)
    assert "Paris" in data[0]["choices"][0]["message"]["content"]
    for d, ids in zip(data, served):
        assert d["usage"]["completion_tokens"] == len(ids) <= MAX_TOKENS
    # accepted length above 1: some drafted token was accepted
    assert max(d["dspark"]["accepted_length"] for d in data) > 1.0
