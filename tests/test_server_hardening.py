"""Hostile and malformed input over real sockets (issue 20).

Every bad request in CASES gets a 4xx with OpenAI's error body and the server
keeps serving: bodies, types, limits, encodings and content types, routing, and
HTTP-level garbage. Further tests cover slow clients (request-head and body
deadlines, idle and trickling connections), disconnects, the connection cap,
500s (generic body, counted in the metrics), tokenization off the event loop,
the cheap length guard, chat text parts and message names.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import attrs
import httpx
import pytest

from dspark_core.engine.request import SamplingParams
from dspark_core.server import AsyncEngineService, BackgroundServer, HttpLimits, build_app
from dspark_core.server.testing import tiny_engine

ENGINE = dict(seed=3, buckets=(1, 2, 4), max_model_len=128, eos=False)
HEAD_TIMEOUT = BODY_TIMEOUT = 0.5
C, CH = "/v1/completions", "/v1/chat/completions"
OK_BODY = {"prompt": "fine", "temperature": 0, "max_tokens": 4}


class InstrumentedTokenizer:
    """The tiny model's tokenizer, plus knobs: prompts containing SLOW take a while to encode (sleeping
    releases the GIL, as the tokenizers library does), EXPLODE raises an unexpected error, and every
    encoded length is recorded."""

    def __init__(self, inner, delay: float = 1.5) -> None:
        self.inner, self.delay, self.encoded = inner, delay, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        if "EXPLODE" in text:
            raise RuntimeError("secret internal detail /srv/weights")
        if "SLOW" in text:
            time.sleep(self.delay)
        return self.inner.encode(text)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if any("SLOWCHAT" in m["content"] for m in messages):
            time.sleep(self.delay)
        return self.inner.apply_chat_template(messages, add_generation_prompt)


def make_server(*, limits: HttpLimits | None = None, tokenizer_wrapper=None):
    service = AsyncEngineService(tiny_engine(**ENGINE), max_pending=16)
    if tokenizer_wrapper is not None:
        service.tokenizer = tokenizer_wrapper(service.tokenizer)
    app = build_app(service, model_name="tiny", body_timeout=BODY_TIMEOUT)
    limits = limits or HttpLimits(header_timeout=HEAD_TIMEOUT, max_header_bytes=16 * 1024)
    return service, app, BackgroundServer(app, limits=limits)


@pytest.fixture(scope="module")
def served():
    service, app, server = make_server(tokenizer_wrapper=InstrumentedTokenizer)
    with server:
        service.mark_ready()
        yield server, service, app


# -- raw HTTP over a socket ---------------------------------------------------------
def request_bytes(path: str = C, body: bytes | str | dict | None = None, *, method: str = "POST",
                  content_type: str | None = "application/json", headers: tuple[str, ...] = (),
                  host: str = "127.0.0.1") -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines += list(headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def read_response(sock: socket.socket):
    """(status, headers, body) of one response, or None when the server closed without answering."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None if not data else pytest.fail(f"truncated response: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def exchange(server, data: bytes, timeout: float = 30.0):
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        def send() -> None:
            try:
                sock.sendall(data)
            except OSError:  # answered early and closed; the answer is read meanwhile
                pass

        # send from a thread and read at once: a server that answers before the body is in
        # (413, 415, ...) may reset the connection when it closes, and a response still waiting
        # unread in this socket's buffer would then be lost (a flaky empty body)
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        response = read_response(sock)
        sender.join(timeout)
        return response


def chunked(body: bytes, size: int = 1 << 16) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def assert_openai_error(response, status: int, needles=(), param=None, code=None):
    assert response is not None, "the server closed the connection without answering"
    got, headers, body = response
    assert got == status, body[:500]
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error, headers


def assert_serving(server):
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
    ok = httpx.post(server.url + C, json=OK_BODY, timeout=30)
    assert ok.status_code == 200, ok.text


def messages(content, **extra):
    return {"messages": [{"role": "user", "content": content, **extra}], "temperature": 0, "max_tokens": 4}


DEEP = b'{"prompt": "x", "temperature": 0, "stop": ' + b"[" * 3000 + b"]" * 3000 + b"}"
BIG_INT = b'{"prompt": "x", "temperature": 0, "max_tokens": ' + b"9" * 5000 + b"}"
OVER = b'{"prompt": "' + b"x" * (4 << 20) + b'", "temperature": 0}'

# (id, raw request, status, message needles, param, code)
CASES = [
    # -- bodies the JSON parser chokes on, or that Python's json accepts but JSON does not
    ("lone-surrogate-prompt", request_bytes(body='{"prompt": "a\\ud800b", "temperature": 0}'), 400,
     ["surrogate", "U+D800", "character 1"], "prompt", "invalid_value"),
    ("lone-surrogate-chat", request_bytes(CH, '{"messages": [{"role": "user", "content": "\\udfff"}], '
                                              '"temperature": 0}'), 400, ["surrogate"], "messages[0].content", None),
    ("lone-surrogate-stop", request_bytes(body='{"prompt": "x", "temperature": 0, "stop": ["ok", "\\ud83d"]}'), 400,
     ["surrogate"], "stop[1]", None),
    ("lone-surrogate-text-part", request_bytes(CH, '{"messages": [{"role": "user", "content": [{"type": "text", '
                                                   '"text": "\\ud800"}]}], "temperature": 0}'), 400,
     ["surrogate"], "messages[0].content[0].text", None),
    # a key the error would quote cannot be written back as UTF-8: refused by the parser, not a 500
    ("lone-surrogate-key", request_bytes(body='{"prompt": "x", "temperature": 0, "\\ud800": 1}'), 400,
     ["lone surrogate U+D800", "object key"], None, "invalid_json"),
    ("lone-surrogate-nested-key", request_bytes(CH, '{"messages": [{"role": "user", "content": "hi", "\\udfff": 1}], '
                                                    '"temperature": 0}'), 400, ["lone surrogate U+DFFF"], None,
     "invalid_json"),
    ("5000-digit-integer", request_bytes(body=BIG_INT), 400, ["too many digits"], None, "invalid_json"),
    ("3000-deep-nesting", request_bytes(body=DEEP), 400, ["nested too deeply"], None, "invalid_json"),
    ("nan-literal", request_bytes(body='{"prompt": "x", "temperature": NaN}'), 400, ["NaN"], None, "invalid_json"),
    ("infinity-literal", request_bytes(body='{"prompt": "x", "temperature": -Infinity}'), 400, ["Infinity"], None,
     "invalid_json"),
    ("number-overflow", request_bytes(body='{"prompt": "x", "temperature": 1e999}'), 400,
     ["temperature", "out of range"], "temperature", "invalid_type"),
    ("duplicate-key", request_bytes(body='{"prompt": "x", "temperature": 0, "temperature": 1}'), 400,
     ["duplicate key 'temperature'"], None, "invalid_json"),
    ("utf16-body", request_bytes(body=json.dumps(OK_BODY).encode("utf-16")), 400, ["not UTF-8"], None, "invalid_json"),
    ("latin1-bytes", request_bytes(body=b'{"prompt": "caf\xe9", "temperature": 0}'), 400,
     ["not UTF-8", "0xe9", "offset 15"], None, "invalid_json"),
    ("utf8-bom", request_bytes(body=b"\xef\xbb\xbf" + json.dumps(OK_BODY).encode()), 400, ["not valid JSON"], None,
     "invalid_json"),
    ("trailing-garbage", request_bytes(body=json.dumps(OK_BODY) + " trailing"), 400, ["Extra data"], None,
     "invalid_json"),
    ("json-null", request_bytes(body="null"), 400, ["JSON object", "null"], None, "invalid_json"),
    ("json-string", request_bytes(body='"prompt"'), 400, ["JSON object", "string"], None, "invalid_json"),
    ("huge-token-id", request_bytes(body='{"prompt": [' + "7" * 4000 + '], "temperature": 0}'), 400,
     ["outside the vocabulary", "(4000 digits)"], "prompt", "invalid_value"),
    # -- chat content parts and message names
    ("image-part", request_bytes(CH, messages([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])), 400,
     ["'image_url' is not supported", "text only"], "messages[0].content[0].type", "unsupported_value"),
    ("audio-part", request_bytes(CH, messages([{"type": "text", "text": "hi"},
                                               {"type": "input_audio", "input_audio": {}}])), 400,
     ["'input_audio' is not supported"], "messages[0].content[1].type", "unsupported_value"),
    ("unknown-part", request_bytes(CH, messages([{"type": "hologram"}])), 400, ["not a known content part type"],
     "messages[0].content[0].type", None),
    ("part-without-type", request_bytes(CH, messages([{"text": "hi"}])), 400, ["required"],
     "messages[0].content[0].type", "missing_field"),
    ("part-without-text", request_bytes(CH, messages([{"type": "text"}])), 400, ["required"],
     "messages[0].content[0].text", "missing_field"),
    ("part-extra-field", request_bytes(CH, messages([{"type": "text", "text": "a", "cache_control": {}}])), 400,
     ["unknown field"], "messages[0].content[0].cache_control", "unknown_field"),
    ("part-not-object", request_bytes(CH, messages(["hi"])), 400, ["object", "got string"], "messages[0].content[0]",
     "invalid_type"),
    ("parts-empty", request_bytes(CH, messages([])), 400, ["must not be empty"], "messages[0].content", None),
    ("content-null", request_bytes(CH, messages(None)), 400, ["string or array of text parts", "null"],
     "messages[0].content", "invalid_type"),
    ("name-ignored-by-template", request_bytes(CH, messages("hi", name="alice")), 400,
     ["does not use message names"], "messages[0].name", "unsupported_value"),
    ("name-not-string", request_bytes(CH, messages("hi", name=7)), 400, ["string", "integer"], "messages[0].name",
     "invalid_type"),
    # -- limits
    ("4mb-prompt", request_bytes(body={"prompt": "y" * 4_000_000, "temperature": 0}), 400,
     ["4000000 characters cannot fit", "at most 111 tokens"], "prompt", "context_length_exceeded"),
    ("huge-chat", request_bytes(CH, messages("z" * 1_000_000)), 400, ["1000000 characters cannot fit"], "messages",
     "context_length_exceeded"),
    ("chunked-over-limit", request_bytes(body=None, headers=("Transfer-Encoding: chunked",)) + chunked(OVER), 413,
     ["exceeds 4194304 bytes"], None, "body_too_large"),
    # a client that announces a large body waits for "100 Continue" before sending it (curl does); the
    # 413 comes first. (One that streams the body regardless may lose the answer to the TCP reset that
    # closing a socket with unread input sends: uvicorn does no lingering close.)
    ("declared-over-limit", request_bytes(body=None, headers=(f"Content-Length: {len(OVER)}",
                                                             "Expect: 100-continue")),
     413, ["exceeds"], None, "body_too_large"),
    ("long-model-name", request_bytes(body={**OK_BODY, "model": "m" * 10_000}), 404, ["not served here", "..."],
     "model", "model_not_found"),
    ("oversized-head", request_bytes(body=OK_BODY, headers=("X-Padding: " + "p" * 40_000,)), 400,
     ["malformed HTTP request", "16384 bytes"], None, "bad_http_request"),
    ("garbage-request-line", b"HELLO THERE\r\n\r\n", 400, ["malformed HTTP request"], None, "bad_http_request"),
    ("bad-content-length", request_bytes(body=None, headers=("Content-Length: ten",)), 400,
     ["malformed HTTP request"], None, "bad_http_request"),
    # -- content types (cross-site form posts must not start generations)
    ("text-plain", request_bytes(body=OK_BODY, content_type="text/plain"), 415, ["expected application/json",
                                                                                 "text/plain"], None,
     "unsupported_media_type"),
    ("form-urlencoded", request_bytes(body="prompt=x&temperature=0",
                                      content_type="application/x-www-form-urlencoded"), 415,
     ["application/x-www-form-urlencoded"], None, "unsupported_media_type"),
    ("multipart", request_bytes(body=OK_BODY, content_type="multipart/form-data; boundary=xyz"), 415,
     ["multipart/form-data"], None, "unsupported_media_type"),
    ("no-content-type", request_bytes(body=OK_BODY, content_type=None), 415, ["missing"], None,
     "unsupported_media_type"),
    ("latin1-charset", request_bytes(body=OK_BODY, content_type="application/json; charset=latin-1"), 415,
     ["charset 'latin-1'", "UTF-8"], None, "unsupported_media_type"),
    ("chat-text-plain", request_bytes(CH, messages("hi"), content_type="text/plain;charset=UTF-8"), 415,
     ["text/plain"], None, "unsupported_media_type"),
    # -- routing
    ("trailing-slash", request_bytes(C + "/", OK_BODY, host="evil.example"), 404,
     ["without the trailing slash"], None, "not_found"),
    ("wrong-method", request_bytes(C, None, method="GET"), 405, ["allowed: POST"], None, "method_not_allowed"),
    ("unknown-path", request_bytes("/v1/embeddings", OK_BODY), 404, ["/v1/embeddings"], None, "not_found"),
]


def test_at_least_35_bad_input_cases():
    assert len(CASES) >= 35 and len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("name,data,status,needles,param,code", CASES, ids=[case[0] for case in CASES])
def test_bad_input_gets_4xx_and_the_server_keeps_serving(served, name, data, status, needles, param, code):
    server, service, app = served
    error, headers = assert_openai_error(exchange(server, data), status, needles, param, code)
    assert "location" not in headers  # never a redirect built from the client's Host header
    if status == 405:
        assert headers["allow"] == "POST"
    if name == "4mb-prompt":  # refused by the cheap guard: the tokenizer never saw the text
        assert max(service.tokenizer.encoded, default=0) < 10_000
    assert_serving(server)


def test_bad_inputs_do_not_disturb_a_running_stream(served):
    """All CASES at once from four threads while a good request streams: its output stays exact."""
    server, service, app = served
    good = {"prompt": "steady", "temperature": 0, "max_tokens": 90, "return_token_ids": True}
    engine = tiny_engine(**ENGINE)
    expected = engine.generate([good["prompt"]], SamplingParams(max_tokens=90))[0]
    engine.close()
    got: dict = {"first": threading.Event()}

    def stream():
        ids = []
        with httpx.stream("POST", server.url + C, json={**good, "stream": True}, timeout=60) as response:
            got["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:]).get("dspark", {}).get("token_ids", [])
                    got["first"].set()
        got["ids"] = ids

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert got["first"].wait(30)
    statuses: dict[str, int] = {}

    def send(cases):
        for name, data, status, *_ in cases:
            response = exchange(server, data)
            statuses[name] = response[0] if response else None

    workers = [threading.Thread(target=send, args=(CASES[i::4],)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    streamer.join(60)
    assert statuses == {name: status for name, _, status, *_ in CASES}
    assert got["status"] == 200 and got["ids"] == list(expected.token_ids)
    assert_serving(server)


# -- slow clients -----------------------------------------------------------------
def test_partial_request_head_gets_408(served):
    server = served[0]
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        started = time.monotonic()
        response = read_response(sock)
        waited = time.monotonic() - started
        assert sock.recv(1) == b""  # and the connection is closed
    assert_openai_error(response, 408, ["request head", "0.5 s"], code="request_timeout")
    assert HEAD_TIMEOUT * 0.8 <= waited < HEAD_TIMEOUT + 5
    assert_serving(server)


def test_slow_body_gets_408(served):
    server, service, app = served
    before = app.state.metrics.requests.labels("completions", "408")._value.get()
    data = request_bytes(body=json.dumps(OK_BODY).ljust(100).encode())
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(data[:-90])  # the head and 10 bytes of a 100-byte body
        response = read_response(sock)
    assert_openai_error(response, 408, ["request body", "not received within 0.5 s", "10 bytes arrived"],
                        code="request_timeout")
    assert app.state.metrics.requests.labels("completions", "408")._value.get() == before + 1
    assert_serving(server)


def test_idle_connection_is_closed(served):
    server = served[0]
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed without a response: nothing was asked
        assert time.monotonic() - started < HEAD_TIMEOUT + 5


def test_trickling_body_after_an_early_answer_is_cut_off(served):
    """A 415 answers before the body is read; a client that keeps trickling the body does not keep the
    connection (and its slot in the connection cap) forever."""
    server = served[0]
    head = request_bytes(body=None, content_type="text/plain", headers=("Content-Length: 100000",))
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(head + b"x")
        assert_openai_error(read_response(sock), 415)
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 10 and not closed:
            try:
                sock.sendall(b"x")
                sock.settimeout(0.1)
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed and time.monotonic() - started < HEAD_TIMEOUT + 5


def test_keep_alive_connection_serves_again_then_times_out(served):
    server = served[0]
    keep = request_bytes(body=OK_BODY).replace(b"Connection: close\r\n", b"")
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(keep)
            status, _, body = read_response(sock)
            assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # then stalls on the third head
        assert_openai_error(read_response(sock), 408, code="request_timeout")


# -- disconnects --------------------------------------------------------------------
def wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_disconnect_mid_body_is_counted_499(served):
    server, service, app = served
    counter = app.state.metrics.requests.labels("completions", "499")
    before = counter._value.get()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(request_bytes(body=json.dumps(OK_BODY).ljust(100).encode())[:-90])
    wait_until(lambda: counter._value.get() == before + 1)
    assert_serving(server)


@pytest.mark.parametrize("cut", ["mid-head", "after-request", "mid-stream"])
def test_disconnects_lose_nothing(served, cut):
    server, service, app = served
    body = {"prompt": "bye", "temperature": 0, "max_tokens": 100, "stream": cut == "mid-stream"}
    data = request_bytes(body=body)
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(data[:20] if cut == "mid-head" else data)
        if cut == "mid-stream":
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
    wait_until(lambda: service.pending == 0)
    assert_serving(server)


def test_a_stream_whose_client_left_before_it_started_is_cancelled_and_counted_499(served):
    """The client goes while its request is being prepared: the stream's body never starts, and the
    request must still be cancelled (not decoded for nobody) and counted as a disconnect."""
    server, service, app = served
    counter = app.state.metrics.requests.labels("completions", "499")
    before = counter._value.get()
    body = {"prompt": "SLOW bye", "temperature": 0, "max_tokens": 100, "stream": True}
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(request_bytes(body=body))  # and closes at once, during the 1.5 s the tokenizer takes
    wait_until(lambda: counter._value.get() == before + 1)
    wait_until(lambda: service.pending == 0)
    assert_serving(server)


# -- the connection cap ---------------------------------------------------------------
def test_connections_beyond_the_cap_get_503():
    service, app, server = make_server(limits=HttpLimits(header_timeout=20, max_connections=3))
    with server:
        service.mark_ready()
        held = [socket.create_connection((server.host, server.port), timeout=10) for _ in range(3)]
        try:
            time.sleep(0.2)
            error, headers = assert_openai_error(exchange(server, request_bytes(body=OK_BODY)), 503,
                                                 ["too many open connections", "limit 3"], code="too_many_connections")
            assert error["type"] == "overloaded_error" and headers["retry-after"] == "1"
        finally:
            for sock in held:
                sock.close()
        wait_until(lambda: httpx.post(server.url + C, json=OK_BODY, timeout=30).status_code == 200)


# -- 500s ------------------------------------------------------------------------------
def test_unexpected_error_is_a_generic_500_and_counted(served):
    server, service, app = served
    counter = app.state.metrics.requests.labels("completions", "500")
    before = counter._value.get()
    response = httpx.post(server.url + C, json={"prompt": "EXPLODE", "temperature": 0}, timeout=30)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "reference" in error["message"] and "secret" not in response.text and "RuntimeError" not in response.text
    assert counter._value.get() == before + 1
    metrics = httpx.get(server.url + "/metrics").text
    assert 'dspark_requests_total{endpoint="completions",status="500"}' in metrics
    assert_serving(server)


# -- the event loop stays free ----------------------------------------------------------
@pytest.mark.parametrize("path,body", [(C, {"prompt": "SLOW prompt", "temperature": 0, "max_tokens": 2}),
                                       (CH, messages("SLOWCHAT please"))], ids=["tokenize", "chat-template"])
def test_slow_preparation_does_not_block_other_requests(served, path, body):
    server = served[0]
    result = {}
    slow = threading.Thread(target=lambda: result.update(r=httpx.post(server.url + path, json=body, timeout=60)))
    slow.start()
    time.sleep(0.3)  # the slow request is now being rendered/tokenized (1.5 s)
    started = time.monotonic()
    health = httpx.get(server.url + "/health", timeout=10)
    other = httpx.post(server.url + C, json=OK_BODY, timeout=30)
    elapsed = time.monotonic() - started
    slow.join(60)
    assert health.status_code == 200 and other.status_code == 200
    assert elapsed < 0.9, f"/health and a small request waited {elapsed:.2f} s behind a slow tokenization"
    assert result["r"].status_code == 200


# -- chat content parts and names --------------------------------------------------------
def test_text_parts_equal_the_joined_string(served):
    server = served[0]
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]
    ids = []
    for content in (parts, "first part\nsecond"):
        r = httpx.post(server.url + CH, json={**messages(content), "return_token_ids": True}, timeout=30)
        assert r.status_code == 200, r.text
        ids.append((r.json()["usage"]["prompt_tokens"], r.json()["dspark"]["token_ids"]))
    assert ids[0] == ids[1]


NAMED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m['name'] is defined %} ({{ m['name'] }})"
                  "{% endif %}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_names_reach_a_template_that_uses_them():
    def named(tokenizer):
        return attrs.evolve(tokenizer, chat_template=NAMED_TEMPLATE)

    service, app, server = make_server(tokenizer_wrapper=named)
    with server:
        service.mark_ready()
        plain = httpx.post(server.url + CH, json=messages("hi"), timeout=30)
        with_name = httpx.post(server.url + CH, json=messages("hi", name="alice"), timeout=30)
    assert plain.status_code == with_name.status_code == 200, with_name.text
    # " (alice)" is 8 more bytes, so 8 more prompt tokens with the byte tokenizer
    assert with_name.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + 8


def test_json_with_utf8_charset_is_accepted(served):
    status, _, body = exchange(served[0], request_bytes(body=OK_BODY, content_type="application/json; charset=UTF-8"))
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
