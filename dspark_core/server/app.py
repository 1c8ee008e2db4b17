"""The OpenAI-compatible Starlette app over an :class:`AsyncEngineService`.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health``, ``/ready`` and ``/metrics``. Requests
are validated strictly (:mod:`dspark_core.server.schema`), tokenized on the
event loop, then handed to the service; a client that disconnects has its
request cancelled so the slot is freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
from dspark_core.server.responses import (DONE, ChunkWriter, TextDeltas, completion_body, dspark_summary, new_id,
                                          read_body, wait_disconnect)
from dspark_core.server.schema import ApiError, GenerationRequest, check_lengths, parse_request
from dspark_core.server.events import Failed, Finished, Submission, Tokens
from dspark_core.server.service import AsyncEngineService

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # status recorded in metrics for requests whose client went away


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def build_app(service: AsyncEngineService, *, model_name: str, metrics: ServerMetrics | None = None,
              completion_max_tokens: int = 16, drain_timeout: float = 30.0,
              max_body_bytes: int = 4 << 20) -> Starlette:
    """The HTTP app. Its lifespan starts the service's engine thread and drains it on shutdown.

    ``completion_max_tokens`` is /v1/completions' default when a request omits
    max_tokens (OpenAI's is 16); chat requests default to the rest of the context.
    Bodies over ``max_body_bytes`` are refused with 413.
    """
    metrics = metrics or ServerMetrics(service.draft_width)
    # steps run by warmup and calibration are not serving traffic
    service.engine.add_observer(lambda report: metrics.observe_step(report) if service.ready else None)
    metrics.bind_queue(lambda: service.waiting, lambda: service.running, lambda: service.pending,
                       lambda: float(service.ready))
    started = int(time.time())

    def encode(req: GenerationRequest) -> list[int]:
        tok = service.tokenizer
        if isinstance(req.prompt, list):
            bad = next((t for t in req.prompt if not 0 <= t < service.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary (0..{service.vocab_size - 1})",
                               param="prompt", code="invalid_value")
            return req.prompt
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt",
                           code="no_tokenizer")
        try:
            text = tok.apply_chat_template(req.messages) if req.chat else req.prompt
            return tok.encode(text)
        except DSparkError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages", code="chat_template") from None

    async def generate(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            refusal = service.unavailable()
            if refusal is not None:
                raise refusal
            req = parse_request(await read_body(request, max_body_bytes), chat=chat)
            if req.model is not None and req.model != model_name:
                raise ApiError(404, f"model: {req.model!r} is not served here; this server serves {model_name!r}",
                               param="model", code="model_not_found", kind="not_found_error")
            if req.stop and service.tokenizer is None:
                raise ApiError(400, "stop: stop strings need a tokenizer and this model has none", param="stop",
                               code="no_tokenizer")
            ids = encode(req)
            max_tokens = check_lengths(len(ids), req.max_tokens, max_model_len=service.max_model_len,
                                       reserve=service.reserve, default_max_tokens=None if chat else completion_max_tokens)
            params = SamplingParams(max_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos)
            sub = service.submit(ids, params, stream=req.stream)
        except ApiError as error:
            metrics.count_request(endpoint, error.status)
            return error_response(error)
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
        metrics.count_request(endpoint, 200)
        body = completion_body(rid, int(time.time()), model_name, chat=chat, text=output.text, output=output,
                               token_ids=req.return_token_ids)
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
                record(sub, event)
                metrics.count_request(endpoint, 200)
                rest = deltas.finish(output.text)
                summary = dspark_summary(output, token_ids=False)
                if req.return_token_ids:
                    summary["token_ids"] = list(output.token_ids[len(deltas.ids):])
                yield writer.chunk(rest, output.finish_reason, extra={"dspark": summary})
                if req.include_usage:
                    yield writer.usage_chunk(output.prompt_tokens, len(output.token_ids))
                yield DONE
                return
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
            return JSONResponse({"status": "failed", "message": f"engine failure: {service.failure!r}"}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        refusal = service.unavailable()
        if refusal is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": refusal.code, "message": refusal.message}, 503)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code="not_found" if exc.status_code == 404 else None,
                                       kind="not_found_error" if exc.status_code == 404 else "invalid_request_error"))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s", request.url.path)
        return error_response(ApiError(500, f"internal server error: {exc!r}", kind="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        service.start()
        yield
        await service.shutdown(drain_timeout)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.service = service
    app.state.metrics = metrics
    return app

