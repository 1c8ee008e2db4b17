"""The HTTP API over a real socket: completions and chat, streamed and not, token-identical to
the in-process engine; /v1/models, /health, /ready gating and /metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark_core.engine.request import SamplingParams
from dspark_core.server import AsyncEngineService, BackgroundServer, build_app
from dspark_core.server.testing import tiny_engine
from engine_support import synthetic_table

BUCKETS = (1, 2, 4)
ENGINE = dict(policy="adaptive", options={}, buckets=BUCKETS, max_model_len=256, overlap=True)
PROMPTS = ["The quick brown fox", "héllo wörld €", "1 2 3 4 5", "a"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 3"}]]
MAX_TOKENS = 40


def make_engine():
    engine = tiny_engine(seed=11, **ENGINE)
    engine.install_table(synthetic_table(7, BUCKETS))
    return engine


@pytest.fixture(scope="module")
def server():
    service = AsyncEngineService(make_engine(), max_pending=32)
    app = build_app(service, model_name="tiny-dspark")
    with BackgroundServer(app) as srv:
        service.mark_ready()
        yield srv


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of an equal in-process engine, keyed by prompt text / chat index."""
    engine = make_engine()
    tok = engine.tokenizer
    texts = [tok.encode(p) for p in PROMPTS] + [tok.encode(tok.apply_chat_template(m)) for m in CHATS]
    outputs = engine.generate(texts, SamplingParams(max_tokens=MAX_TOKENS))
    engine.close()
    return {"completions": outputs[: len(PROMPTS)], "chat": outputs[len(PROMPTS):]}


def body(prompt, **extra):
    key = "messages" if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else "prompt"
    return {key: prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "return_token_ids": True, **extra}


async def post_all(url, path, bodies):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


async def stream_all(url, path, bodies):
    async def one(client, b):
        events = []
        async with client.stream("POST", path, json={**b, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line:
                    assert line.startswith("data: ")
                    events.append(line[len("data: "):])
        return events

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(one(client, b) for b in bodies))


def test_completions_match_engine(server, reference):
    responses = asyncio.run(post_all(server.url, "/v1/completions", [body(p) for p in PROMPTS]))
    for response, ref in zip(responses, reference["completions"], strict=True):
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["object"] == "text_completion" and data["model"] == "tiny-dspark"
        assert data["id"].startswith("cmpl-") and isinstance(data["created"], int)
        choice = data["choices"][0]
        assert choice["index"] == 0 and choice["finish_reason"] == ref.finish_reason
        assert data["dspark"]["token_ids"] == list(ref.token_ids)
        assert choice["text"] == ref.text
        assert data["usage"] == {"prompt_tokens": ref.prompt_tokens, "completion_tokens": len(ref.token_ids),
                                 "total_tokens": ref.prompt_tokens + len(ref.token_ids)}
        ext = data["dspark"]
        assert ext["steps"] >= 1 and 0.0 <= ext["acceptance"] <= 1.0 and ext["accepted_length"] >= 1.0
        assert sum(ext["verify_widths"]["counts"].values()) == ext["steps"]
        assert 0 <= ext["verify_widths"]["min"] <= ext["verify_widths"]["max"] <= 7


def test_chat_matches_engine(server, reference):
    responses = asyncio.run(post_all(server.url, "/v1/chat/completions", [body(m, model="tiny-dspark") for m in CHATS]))
    for response, ref in zip(responses, reference["chat"], strict=True):
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
        choice = data["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": ref.text}
        assert choice["finish_reason"] == ref.finish_reason
        assert data["dspark"]["token_ids"] == list(ref.token_ids)
        assert data["usage"]["prompt_tokens"] == ref.prompt_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_matches_engine(server, reference, chat):
    prompts = CHATS if chat else PROMPTS
    path = "/v1/chat/completions" if chat else "/v1/completions"
    bodies = [body(p, stream_options={"include_usage": True}) for p in prompts]
    streams = asyncio.run(stream_all(server.url, path, bodies))
    for events, ref in zip(streams, reference["chat" if chat else "completions"], strict=True):
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
        usage_chunk, content = chunks[-1], chunks[:-1]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(ref.token_ids)
        if chat:
            assert content[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
        else:
            text = "".join(c["choices"][0]["text"] for c in content)
        ids = [t for c in content for t in c.get("dspark", {}).get("token_ids", [])]
        assert ids == list(ref.token_ids)
        assert text == ref.text
        assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + [ref.finish_reason]
        assert content[-1]["dspark"]["steps"] >= 1


def test_stop_strings_cut_text_in_both_modes(server, reference):
    ref = reference["completions"][0]
    assert len(ref.text) > 6
    stop = ref.text[3:6]  # occurs in the output, so generation stops there
    cut = ref.text[: ref.text.index(stop)]
    plain = httpx.post(server.url + "/v1/completions", json=body(PROMPTS[0], stop=[stop, "zzzz"]), timeout=60).json()
    assert plain["choices"][0] == {"index": 0, "text": cut, "logprobs": None, "finish_reason": "stop"}
    events = asyncio.run(stream_all(server.url, "/v1/completions", [body(PROMPTS[0], stop=stop)]))[0]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_what_typed_clients_send_gets_the_same_answer(server, reference):
    """Fields sent as null (known or not), a prompt wrapped in a one-element list, and chat messages
    carrying null fields ask for nothing: the answers are the engine's, as without them."""
    nulls = {"logprobs": None, "tools": None, "response_format": None, "seed": None, "user": None}
    completion = httpx.post(server.url + "/v1/completions", json=body([PROMPTS[0]], **nulls), timeout=60)
    assert completion.status_code == 200, completion.text
    assert completion.json()["dspark"]["token_ids"] == list(reference["completions"][0].token_ids)
    turns = [dict(m, name=None, tool_calls=None) for m in CHATS[1]]
    chat = httpx.post(server.url + "/v1/chat/completions", json=body(turns, **nulls), timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["dspark"]["token_ids"] == list(reference["chat"][1].token_ids)


def test_token_id_prompts_and_default_max_tokens(server):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": [72, 105], "temperature": 0.0}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 2
    assert response.json()["usage"]["completion_tokens"] <= 16  # OpenAI's completions default


def test_models_health_and_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-dspark"
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(server.url + "/v1/models/tiny-dspark").json() == models["data"][0]  # retrieve one
    other = httpx.get(server.url + "/v1/models/org/other")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert "'org/other'" in other.json()["error"]["message"] and "'tiny-dspark'" in other.json()["error"]["message"]
    slash = httpx.get(server.url + "/v1/models/")
    assert slash.status_code == 404 and "without the trailing slash" in slash.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200

    def scrape():
        text = httpx.get(server.url + "/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
                if "le" not in sample.labels:
                    values[key] = sample.value
        return values

    before = scrape()
    responses = asyncio.run(post_all(server.url, "/v1/completions", [body(p) for p in PROMPTS[:2]]))
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert bad.status_code == 400
    after = scrape()
    out_tokens = sum(r.json()["usage"]["completion_tokens"] for r in responses)
    assert after["dspark_output_tokens_total"] - before.get("dspark_output_tokens_total", 0) == out_tokens
    ok = "dspark_requests_total|endpoint=completions|status=200"
    assert after[ok] - before.get(ok, 0) == 2
    assert after["dspark_requests_total|endpoint=completions|status=400"] >= 1
    for name in ("dspark_decode_steps_total", "dspark_draft_tokens_verified_total", "dspark_time_to_first_token_seconds_count",
                 "dspark_time_per_output_token_seconds_count", "dspark_verify_width_count",
                 "dspark_step_predicted_tokens_count", "dspark_step_realized_tokens_count", "dspark_committed_tokens_total"):
        assert after[name] > before.get(name, 0), name
    assert 0.0 <= after["dspark_acceptance_rate"] <= 1.0
    assert after["dspark_mean_accepted_length"] >= 1.0
    assert after["dspark_output_tokens_per_second"] > 0
    assert "dspark_full_width_fallbacks_total" in after
    assert "dspark_draft_off_steps_total" in after
    assert after["dspark_ready"] == 1.0
    assert after["dspark_queue_depth|state=admitted"] == 0
    assert after["dspark_requests_finished_total|reason=length"] >= 2
    # every decode step was timed, under one of three kinds
    timed_steps = sum(after.get(f"dspark_step_seconds_count|kind={k}", 0) - before.get(f"dspark_step_seconds_count|kind={k}", 0)
                      for k in ("drafted", "draft_off", "copy"))
    assert timed_steps == after["dspark_decode_steps_total"] - before.get("dspark_decode_steps_total", 0) > 0


def test_ready_gating():
    service = AsyncEngineService(tiny_engine(seed=2, buckets=(1,), max_model_len=128, overlap=False), max_pending=4)
    with BackgroundServer(build_app(service, model_name="gated")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        ready = httpx.get(srv.url + "/ready")
        assert ready.status_code == 503 and "not ready" in ready.json()["status"]
        for path, key in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
            payload = "hi" if key == "prompt" else [{"role": "user", "content": "hi"}]
            early = httpx.post(srv.url + path, json={key: payload, "temperature": 0, "max_tokens": 4})
            assert early.status_code == 503 and "not ready" in early.json()["error"]["message"]
        service.mark_ready()
        assert httpx.get(srv.url + "/ready").status_code == 200
        late = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "temperature": 0, "max_tokens": 4})
        assert late.status_code == 200 and late.json()["usage"]["completion_tokens"] <= 4


def test_prepare_installs_on_the_engine_thread_then_marks_ready():
    import threading

    service = AsyncEngineService(tiny_engine(seed=2, buckets=BUCKETS, max_model_len=128, overlap=False), max_pending=4)
    release = threading.Event()
    seen = {}

    def setup(engine):  # stands in for warmup + startup calibration
        seen["thread"] = threading.current_thread().name
        release.wait(10)
        engine.install_table(synthetic_table(7, BUCKETS))

    with BackgroundServer(build_app(service, model_name="prepared")) as srv:
        future = service.prepare(setup)
        assert httpx.get(srv.url + "/ready").json()["reason"] == "not_ready"
        release.set()
        future.result(10)
        assert seen["thread"] == "dspark-engine"
        assert httpx.get(srv.url + "/ready").status_code == 200
        assert service.call(lambda e: e.table is not None).result(10)

    failing = AsyncEngineService(tiny_engine(seed=2, buckets=(1,), max_model_len=128, overlap=False))
    with BackgroundServer(build_app(failing, model_name="broken")) as srv:
        future = failing.prepare(lambda engine: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            future.result(10)
        assert httpx.get(srv.url + "/health").status_code == 503
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "temperature": 0})
        assert refused.status_code == 503 and "ZeroDivisionError" in refused.json()["error"]["message"]
