"""The OpenAI-compatible Starlette app over an :class:`AsyncEngineService`.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health``, ``/ready`` and ``/metrics``. A
generation request must be ``application/json``; its body is read under a size
and a time limit, then parsed, validated (:mod:`dspark_core.server.schema`),
rendered and tokenized on a small worker pool, never on the event loop, so a
huge prompt cannot stall other requests, streams or ``/health``. Prompts too
long to possibly fit the context are refused before tokenizing. Then the
request is handed to the service; a client that disconnects has its request
cancelled so the slot is freed at once. Unexpected exceptions become a 500
with a reference to the server log, never the exception text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dspark_core.engine.request import SamplingParams
from dspark_core.errors import DSparkError
from dspark_core.server.metrics import ServerMetrics
from dspark_core.server.responses import (DONE, ChunkWriter, ClientGone, TextDeltas, check_content_type,
                                          completion_body, dspark_summary, new_id, read_body, wait_disconnect)
from dspark_core.server.schema import ApiError, GenerationRequest, check_lengths, parse_request
from dspark_core.server.events import Failed, Finished, Submission, Tokens
from dspark_core.server.service import AsyncEngineService

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # status recorded in metrics for requests whose client went away
PROMPT_SLACK = 2  # the cheap length guard allows this many times the characters that could possibly fit
GENERATION_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def error_response(error: ApiError, *, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI error body (a request body left unread is drained under the HTTP layer's deadline)."""
    headers = dict(headers or {})
    if error.status in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


def internal_error(where: str, exc: BaseException) -> ApiError:
    """A 500 that names a log reference instead of the exception (whose text may expose internals)."""
    ref = uuid.uuid4().hex[:12]
    log.error("unhandled error (reference %s) in %s", ref, where, exc_info=exc)
    return ApiError(500, f"internal server error (reference {ref} in the server log)", code="internal_error",
                    kind="server_error")


def longest_token_chars(tokenizer) -> int | None:
    """Characters of the longest vocabulary entry, or None when the tokenizer does not tell.

    No token covers more text characters than its vocabulary string has
    (byte-level entries have one character per byte), so a text of n characters
    needs at least n / longest tokens.
    """
    get_vocab = getattr(getattr(tokenizer, "backend", None), "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return max((len(token) for token in get_vocab(with_added_tokens=True)), default=None)
    except Exception:  # an unusual backend: skip the cheap guard, tokenizing still bounds the length
        return None


def build_app(service: AsyncEngineService, *, model_name: str, metrics: ServerMetrics | None = None,
              completion_max_tokens: int = 16, drain_timeout: float = 30.0,
              max_body_bytes: int = 4 << 20, body_timeout: float = 30.0, prepare_workers: int = 2) -> Starlette:
    """The HTTP app. Its lifespan starts the service's engine thread and drains it on shutdown.

    ``completion_max_tokens`` is /v1/completions' default when a request omits
    max_tokens (OpenAI's is 16); chat requests default to the rest of the context.
    Bodies over ``max_body_bytes`` are refused with 413, bodies not received
    within ``body_timeout`` seconds with 408. ``prepare_workers`` threads parse,
    render and tokenize requests off the event loop.
    """
    metrics = metrics or ServerMetrics(service.draft_width)
    # steps run by warmup and calibration are not serving traffic
    service.engine.add_observer(lambda report: metrics.observe_step(report) if service.ready else None)
    metrics.bind_queue(lambda: service.waiting, lambda: service.running, lambda: service.pending,
                       lambda: float(service.ready))
    started = int(time.time())

    tokenizer = service.tokenizer
    longest = longest_token_chars(tokenizer)
    prompt_tokens = service.max_model_len - service.reserve - 1  # the most a prompt may have
    text_limit = None if longest is None else PROMPT_SLACK * longest * max(prompt_tokens, 1)
    workers = concurrent.futures.ThreadPoolExecutor(max_workers=prepare_workers, thread_name_prefix="dspark-prepare")
    template_errors: tuple[type[BaseException], ...] = (DSparkError,)
    with contextlib.suppress(ImportError):
        from jinja2 import TemplateError
        template_errors = (DSparkError, TemplateError)

    def guard_length(param: str, chars: int) -> None:
        """Refuse, without tokenizing, text too long to fit the context whatever its tokens."""
        if text_limit is not None and chars > text_limit:
            raise ApiError(400, f"{param}: {chars} characters cannot fit this model's context: a prompt may have "
                           f"at most {prompt_tokens} tokens and no token spans more than {longest} characters",
                           param=param, code="context_length_exceeded")

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return tokenizer.apply_chat_template(messages)
        except template_errors as exc:
            raise ApiError(400, f"messages: {exc}", param="messages", code="chat_template") from None

    def encode(req: GenerationRequest) -> list[int]:
        if isinstance(req.prompt, list):
            bad = next((t for t in req.prompt if not 0 <= t < service.vocab_size), None)
            if bad is not None:
                shown = str(bad) if abs(bad) < 10**30 else f"{str(bad)[:12]}... ({len(str(abs(bad)))} digits)"
                raise ApiError(400, f"prompt: token id {shown} is outside the vocabulary (0..{service.vocab_size - 1})",
                               param="prompt", code="invalid_value")
            return req.prompt
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt",
                           code="no_tokenizer")
        param = "messages" if req.chat else "prompt"
        if req.chat:
            guard_length(param, sum(len(m["content"]) for m in req.messages))
            text = render(req.messages)
            named = [i for i, m in enumerate(req.messages) if "name" in m]
            if named and render([{k: v for k, v in m.items() if k != "name"} for m in req.messages]) == text:
                where = f"messages[{named[0]}].name"
                raise ApiError(400, f"{where}: this model's chat template does not use message names, so the name "
                               "would be ignored; remove it (or put it in the content)", param=where,
                               code="unsupported_value")
        else:
            text = req.prompt
        guard_length(param, len(text))
        try:
            return tokenizer.encode(text)
        except (TypeError, ValueError) as exc:  # input the tokenizer cannot take (validation should catch it first)
            raise ApiError(400, f"{param}: the tokenizer cannot encode this text ({type(exc).__name__})",
                           param=param, code="invalid_value") from None

    def prepare(body: bytes, chat: bool) -> tuple[GenerationRequest, list[int]]:
        """Parse, validate, render and tokenize (on the worker pool: all of it may be slow for big bodies)."""
        req = parse_request(body, chat=chat)
        if req.model is not None and req.model != model_name:
            shown = req.model if len(req.model) <= 200 else req.model[:200] + "..."
            raise ApiError(404, f"model: {shown!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found", kind="not_found_error")
        if req.stop and tokenizer is None:
            raise ApiError(400, "stop: stop strings need a tokenizer and this model has none", param="stop",
                           code="no_tokenizer")
        return req, encode(req)

    async def generate(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            try:
                refusal = service.unavailable()
                if refusal is not None:
                    raise refusal
                check_content_type(request.headers.get("content-type"))
                body = await read_body(request, max_body_bytes, body_timeout)
                loop = asyncio.get_running_loop()
                req, ids = await loop.run_in_executor(workers, prepare, body, chat)
                max_tokens = check_lengths(len(ids), req.max_tokens, max_model_len=service.max_model_len,
                                           reserve=service.reserve,
                                           default_max_tokens=None if chat else completion_max_tokens)
                params = SamplingParams(max_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos)
                sub = service.submit(ids, params, stream=req.stream)
            except ApiError as error:
                metrics.count_request(endpoint, error.status)
                return error_response(error)
            except ClientGone:
                metrics.count_request(endpoint, CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            return await respond(request, sub, req, chat, endpoint)
        except Exception as exc:
            metrics.count_request(endpoint, 500)
            return error_response(internal_error(request.url.path, exc))

    async def respond(request: Request, sub: Submission, req: GenerationRequest, chat: bool, endpoint: str) -> Response:
        rid = new_id(chat)
        if req.stream:
            return StreamingResponse(stream(sub, req, rid, endpoint), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        event = await wait_final(sub, request)
        if event is None or (isinstance(event, Finished) and event.output is None):  # the client went away
            metrics.count_request(endpoint, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(event, Failed):
            metrics.count_request(endpoint, event.error.status)
            return error_response(event.error)
        output = event.output
        record(sub, event)
        body = completion_body(rid, int(time.time()), model_name, chat=chat, text=output.text, output=output,
                               token_ids=req.return_token_ids)
        metrics.count_request(endpoint, 200)
        return JSONResponse(body)

    def record(sub: Submission, event: Finished) -> None:
        n = len(event.output.token_ids) if event.output is not None else sub.sent
        metrics.observe_request(prompt_tokens=len(sub.prompt), output_tokens=n, reason=event.reason,
                                submitted=sub.submitted, first_token=sub.first_token, last_token=sub.last_token)

    async def wait_final(sub: Submission, request: Request) -> Finished | Failed | None:
        """The final event, or None after cancelling the request when the client disconnects first."""
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        try:
            while True:
                get = asyncio.ensure_future(sub.events.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None
                event = get.result()
                if isinstance(event, Finished | Failed):
                    return event
        finally:  # also reached when uvicorn cancels the handler (graceful-shutdown timeout)
            disconnect.cancel()
            service.cancel(sub)  # a no-op once the request finished

    async def stream(sub: Submission, req: GenerationRequest, rid: str, endpoint: str) -> AsyncIterator[bytes]:
        writer = ChunkWriter(rid, model_name, chat=req.chat)
        deltas = TextDeltas(service.tokenizer, req.stop)
        finished = False
        try:
            if req.chat:
                yield writer.chunk("", role=True)
            while True:
                event = await sub.events.get()
                if isinstance(event, Tokens):
                    text = deltas.add(event.ids)
                    extra = {"dspark": {"token_ids": list(event.ids)}} if req.return_token_ids else None
                    if text or extra:
                        yield writer.chunk(text, extra=extra)
                    continue
                finished = True
                if isinstance(event, Failed):
                    metrics.count_request(endpoint, event.error.status)
                    yield b"data: " + JSONResponse(event.error.body()).body + b"\n\n"
                    yield DONE
                    return
                output = event.output
                rest = deltas.finish(output.text)
                summary = dspark_summary(output, token_ids=False)
                if req.return_token_ids:
                    summary["token_ids"] = list(output.token_ids[len(deltas.ids):])
                last = writer.chunk(rest, output.finish_reason, extra={"dspark": summary})
                usage = writer.usage_chunk(output.prompt_tokens, len(output.token_ids)) if req.include_usage else b""
                record(sub, event)
                metrics.count_request(endpoint, 200)
                yield last
                if usage:
                    yield usage
                yield DONE
                return
        except Exception as exc:  # a bug while streaming: end this stream cleanly, keep serving the others
            finished = True
            service.cancel(sub)
            metrics.count_request(endpoint, 500)
            yield b"data: " + JSONResponse(internal_error(f"stream {rid}", exc).body()).body + b"\n\n"
            yield DONE
        finally:
            if not finished:  # the client disconnected mid-stream (or the server is closing the connection)
                service.cancel(sub)
                metrics.count_request(endpoint, CLIENT_CLOSED)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": started, "owned_by": "dspark-core",
            "max_model_len": service.max_model_len}]})

    async def health(request: Request) -> Response:
        if service.failure is not None:
            return JSONResponse({"status": "failed", "message": f"engine failure ({type(service.failure).__name__}; "
                                 "details are in the server log)"}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        refusal = service.unavailable()
        if refusal is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": refusal.code, "message": refusal.message}, 503)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        path = request.url.path
        headers = dict(exc.headers or {})  # 405 carries Allow
        if exc.status_code == 404:
            hint = ""
            if path.rstrip("/") in known_paths and path != path.rstrip("/"):
                hint = f" (did you mean {path.rstrip('/')}, without the trailing slash?)"
            error = ApiError(404, f"{request.method} {path}: no such endpoint{hint}", code="not_found",
                             kind="not_found_error")
        elif exc.status_code == 405:
            allowed = headers.get("Allow") or headers.get("allow") or ""
            error = ApiError(405, f"{request.method} {path}: method not allowed (allowed: {allowed})",
                             code="method_not_allowed")
        else:
            error = ApiError(exc.status_code, f"{request.method} {path}: {exc.detail}")
        return error_response(error, headers=headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        endpoint = GENERATION_PATHS.get(request.url.path)
        if endpoint is not None:
            metrics.count_request(endpoint, 500)
        return error_response(internal_error(request.url.path, exc))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        service.start()
        try:
            yield
            await service.shutdown(drain_timeout)
        finally:
            workers.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    known_paths = {route.path for route in routes}
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    # Starlette would answer /v1/completions/ with a redirect built from the client's Host header
    app.router.redirect_slashes = False
    app.state.service = service
    app.state.metrics = metrics
    return app

