"""Every bad request gets its status and a message naming the problem, while a concurrent good
request keeps streaming and still returns the engine's exact output."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from dspark_core.engine.request import SamplingParams
from dspark_core.server import AsyncEngineService, BackgroundServer, build_app
from dspark_core.server.testing import tiny_engine

ENGINE = dict(seed=5, buckets=(1, 2, 4), max_model_len=128, eos=False)
GOOD = {"prompt": "keep going", "temperature": 0, "max_tokens": 90, "return_token_ids": True}
MSG = [{"role": "user", "content": "hi"}]

# (path, raw body or JSON object, status, substrings the error message must contain, param)
C, CH = "/v1/completions", "/v1/chat/completions"
CASES = [
    (C, b"{not json", 400, ["not valid JSON"], None),
    (C, b"", 400, ["not valid JSON"], None),
    (C, b"\xff\xfe", 400, ["not valid JSON"], None),
    (C, b"[1, 2]", 400, ["JSON object", "array"], None),
    (C, {"prompt": "x"}, 400, ["temperature", "required", "temperature=0"], "temperature"),
    (C, {"prompt": "x", "temperature": 0.7}, 400, ["temperature", "must be 0", "0.7"], "temperature"),
    (C, {"prompt": "x", "temperature": 1}, 400, ["temperature", "must be 0"], "temperature"),
    (C, {"prompt": "x", "temperature": "0"}, 400, ["temperature", "number", "string"], "temperature"),
    (C, {"prompt": "x", "temperature": None}, 400, ["temperature", "null"], "temperature"),
    (C, {"prompt": "x", "temperature": True}, 400, ["temperature", "boolean"], "temperature"),
    (CH, {"messages": MSG}, 400, ["temperature", "required"], "temperature"),
    (CH, {"messages": MSG, "temperature": 0.2}, 400, ["temperature", "0.2"], "temperature"),
    (C, {"prompt": "x", "temperature": 0, "logprobs": 2}, 400, ["unknown field", "logprobs"], "logprobs"),
    (C, {"prompt": "x", "temperature": 0, "zeta": 1, "alpha": 2}, 400, ["alpha, zeta"], "alpha"),
    # a client-chosen key is quoted cut short, and a flood of them by count
    (C, {"prompt": "x", "temperature": 0, "k" * 5000: 1}, 400, ["k" * 64 + "… (5000 characters)"], "k" * 64 + "… (5000 characters)"),
    (C, {"prompt": "x", "temperature": 0, **{f"x{i:03d}": 1 for i in range(30)}}, 400, ["x009 and 20 more"], "x000"),
    (CH, {"messages": MSG, "temperature": 0, "prompt": "x"}, 400, ["unknown field", "prompt"], "prompt"),
    (C, {"messages": MSG, "temperature": 0}, 400, ["unknown field", "messages"], "messages"),
    (CH, {"messages": [{"role": "user", "content": "x", "tool": 1}], "temperature": 0}, 400,
     ["messages[0].tool", "unknown field"], "messages[0].tool"),
    (C, {"prompt": "x", "temperature": 0, "max_tokens": "10"}, 400, ["max_tokens", "integer", "string"], "max_tokens"),
    (C, {"prompt": "x", "temperature": 0, "max_tokens": 2.5}, 400, ["max_tokens", "integer", "number"], "max_tokens"),
    (C, {"prompt": "x", "temperature": 0, "max_tokens": 0}, 400, ["max_tokens", "at least 1"], "max_tokens"),
    (C, {"prompt": "x", "temperature": 0, "stream": "yes"}, 400, ["stream", "boolean", "string"], "stream"),
    (C, {"prompt": 5, "temperature": 0}, 400, ["prompt", "string or array of token ids", "integer"], "prompt"),
    (C, {"prompt": ["a", "b"], "temperature": 0}, 400, ["prompt", "2 strings", "one prompt per request"], "prompt"),
    (C, {"prompt": [""], "temperature": 0}, 400, ["prompt", "empty"], "prompt"),
    (C, {"prompt": [[1, 2]], "temperature": 0}, 400, ["prompt[0]", "integer token id", "array"], "prompt[0]"),
    (C, {"prompt": [1, 2.0], "temperature": 0}, 400, ["prompt[1]", "integer token id", "number"], "prompt[1]"),
    (C, {"prompt": [1, True], "temperature": 0}, 400, ["prompt[1]", "boolean"], "prompt[1]"),
    (CH, {"messages": [{"role": "user", "content": "y " * 200}], "temperature": 0}, 400,
     ["messages: the conversation in the chat template is", "context is 128"], "messages"),
    (C, {"prompt": [1, 99999], "temperature": 0}, 400, ["token id 99999", "vocabulary"], "prompt"),
    (CH, {"messages": "hi", "temperature": 0}, 400, ["messages", "array", "string"], "messages"),
    (CH, {"messages": [{"role": "user", "content": 3}], "temperature": 0}, 400,
     ["messages[0].content", "string", "integer"], "messages[0].content"),
    (CH, {"messages": [{"role": "robot", "content": "x"}], "temperature": 0}, 400, ["messages[0].role", "robot"],
     "messages[0].role"),
    (CH, {"messages": [{"content": "x"}], "temperature": 0}, 400, ["messages[0].role", "required"], "messages[0].role"),
    (C, {"prompt": "", "temperature": 0}, 400, ["prompt", "empty"], "prompt"),
    (C, {"prompt": [], "temperature": 0}, 400, ["prompt", "empty"], "prompt"),
    (CH, {"messages": [], "temperature": 0}, 400, ["messages", "empty"], "messages"),
    (CH, {"messages": [{"role": "user", "content": ""}], "temperature": 0}, 400, ["messages", "empty"], "messages"),
    (C, {"prompt": "y" * 200, "temperature": 0}, 400, ["200 tokens", "context is 128", "16 are reserved", "at most 111"],
     "prompt"),
    (C, {"prompt": "abc", "temperature": 0, "max_tokens": 200}, 400,
     ["prompt (3 tokens) + max_tokens (200) = 203", "112", "at most 109"], "max_tokens"),
    (CH, {"messages": MSG, "temperature": 0, "max_completion_tokens": 500}, 400,
     ["max_completion_tokens: prompt", "max_completion_tokens (500)"], "max_completion_tokens"),
    (CH, {"messages": MSG, "temperature": 0, "max_tokens": 500, "max_completion_tokens": 500}, 400,
     ["max_tokens: prompt", "max_tokens (500)"], "max_tokens"),
    (C, {"prompt": "x", "temperature": 0, "n": 2}, 400, ["n", "must be 1"], "n"),
    (C, {"prompt": "x", "temperature": 0, "top_p": 0.9}, 400, ["top_p", "greedy"], "top_p"),
    (C, {"prompt": "x", "temperature": 0, "stop": ["a"] * 5}, 400, ["stop", "at most 4"], "stop"),
    (C, {"prompt": "x", "temperature": 0, "stop": [""]}, 400, ["stop", "empty"], "stop"),
    (C, {"prompt": "x", "temperature": 0, "stop": 7}, 400, ["stop", "string"], "stop"),
    (C, {"prompt": "x", "temperature": 0, "stream_options": {"include_usage": True}}, 400,
     ["stream_options", "stream=true"], "stream_options"),
    (C, {"prompt": "x", "temperature": 0, "stream_options": {"include_usage": False}}, 400,
     ["stream_options", "stream=true"], "stream_options"),
    (C, {"prompt": "x", "temperature": 0, "logprobs": None, "tools": [], "echo": None}, 400,
     ["unknown field tools"], "tools"),  # a null asks for nothing; a value does
    (C, {"prompt": "x", "temperature": 0, "model": "gpt-4"}, 404, ["gpt-4", "tiny"], "model"),
    (C, b'{"prompt": "' + b"x" * (5 << 20) + b'", "temperature": 0}', 413, ["exceeds 4194304 bytes"], None),
]


@pytest.fixture(scope="module")
def server():
    service = AsyncEngineService(tiny_engine(**ENGINE), max_pending=16)
    with BackgroundServer(build_app(service, model_name="tiny")) as srv:
        service.mark_ready()
        yield srv


def check_error(response, status, needles, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    assert error["param"] == param


def test_bad_requests_while_a_good_one_streams(server):
    engine = tiny_engine(**ENGINE)
    expected = engine.generate([GOOD["prompt"]], SamplingParams(max_tokens=GOOD["max_tokens"]))[0]
    engine.close()
    got: dict = {}

    def good_stream():
        ids = []
        with httpx.stream("POST", server.url + C, json={**GOOD, "stream": True}, timeout=60) as response:
            got["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:]).get("dspark", {}).get("token_ids", [])
                    got.setdefault("first_chunk", threading.Event()).set()
        got["ids"] = ids

    got["first_chunk"] = threading.Event()
    thread = threading.Thread(target=good_stream)
    thread.start()
    assert got["first_chunk"].wait(30)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, payload, status, needles, param in CASES:
            if isinstance(payload, bytes):
                response = client.post(path, content=payload, headers={"content-type": "application/json"})
            else:
                response = client.post(path, json=payload)
            check_error(response, status, needles, param)
        plain = client.post(C, json=GOOD)  # a non-streamed good request in between
        assert plain.status_code == 200 and plain.json()["dspark"]["token_ids"] == list(expected.token_ids)
    thread.join(60)
    assert got["status"] == 200 and got["ids"] == list(expected.token_ids)


def test_optional_fields_sent_as_null_take_their_defaults(server):
    nulls = {name: None for name in ("model", "max_tokens", "stream", "stream_options", "stop", "n", "user", "seed",
                                     "top_p", "presence_penalty", "frequency_penalty", "ignore_eos",
                                     "return_token_ids")}
    response = httpx.post(server.url + C, json={"prompt": "keep going", "temperature": 0, **nulls}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16  # the completions default, as when omitted
    chat = httpx.post(server.url + CH, json={"messages": MSG, "temperature": 0, "max_completion_tokens": None,
                                             **nulls}, timeout=30)
    assert chat.status_code == 200, chat.text
    # the required fields still need a value
    check_error(httpx.post(server.url + CH, json={"messages": None, "temperature": 0}, timeout=30), 400,
                ["messages", "array", "null"], "messages")


def test_routing_errors_are_json(server):
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "/v1/nothing" in missing.json()["error"]["message"]
    wrong_method = httpx.get(server.url + C)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
