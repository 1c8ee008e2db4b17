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

import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dspark_core.server.failures import CLIENT_CLOSED, error_response, internal_error
from dspark_core.server.generation import GenerationHandler
from dspark_core.server.metrics import ServerMetrics
from dspark_core.server.prepare import PROMPT_SLACK, RequestPreparer, longest_token_chars, model_not_found
from dspark_core.server.schema import ApiError
from dspark_core.server.service import AsyncEngineService

__all__ = ["CLIENT_CLOSED", "GENERATION_PATHS", "PROMPT_SLACK", "build_app", "error_response", "internal_error",
           "longest_token_chars"]

GENERATION_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


# -- small endpoints: everything they need is on app.state ------------------------------

def _model_card(state: Any) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "dspark-core",
            "max_model_len": state.service.max_model_len}


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the one served model."""
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state)]})


async def retrieve_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the served model's card, or a 404 naming the one that is served."""
    state = request.app.state
    name = request.path_params["model"]
    if not name:  # "/v1/models/": the list was meant
        return await http_error(request, HTTPException(404))
    if name != state.model_name:
        return error_response(model_not_found(name, state.model_name))
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    """``GET /health``: 200 while the engine thread has not failed (also during startup)."""
    failure = request.app.state.service.failure
    if failure is not None:
        return JSONResponse({"status": "failed", "message": f"engine failure ({type(failure).__name__}; "
                             "details are in the server log)"}, 503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """``GET /ready``: 200 once the service takes requests, else 503 with the reason."""
    refusal = request.app.state.service.unavailable()
    if refusal is None:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not ready", "reason": refusal.code, "message": refusal.message}, 503)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: the Prometheus exposition."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# -- errors Starlette raises before or around a handler ---------------------------------

async def http_error(request: Request, exc: HTTPException) -> Response:
    """404 and 405 (and any other HTTPException) as OpenAI error bodies; a trailing slash gets a hint."""
    path = request.url.path
    headers = dict(exc.headers or {})  # 405 carries Allow
    if exc.status_code == 404:
        hint = ""
        known_paths = {route.path for route in request.app.routes}
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
    """An exception no handler caught: a 500 with a log reference, counted for generation endpoints."""
    endpoint = GENERATION_PATHS.get(request.url.path)
    if endpoint is not None:
        request.app.state.metrics.count_request(endpoint, 500)
    return error_response(internal_error(request.url.path, exc))


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """Start the engine thread; on shutdown drain it, then stop the prepare workers."""
    state = app.state
    state.service.start()
    try:
        yield
        await state.service.shutdown(state.drain_timeout)
    finally:
        state.workers.shutdown(wait=False, cancel_futures=True)


def build_app(service: AsyncEngineService, *, model_name: str, metrics: ServerMetrics | None = None,
              completion_max_tokens: int = 16, drain_timeout: float = 30.0,
              max_body_bytes: int = 4 << 20, body_timeout: float = 30.0, prepare_workers: int = 2,
              log_requests: bool = True) -> Starlette:
    """The HTTP app. Its lifespan starts the service's engine thread and drains it on shutdown.

    ``completion_max_tokens`` is /v1/completions' default when a request omits
    max_tokens (OpenAI's is 16); chat requests default to the rest of the context.
    Bodies over ``max_body_bytes`` are refused with 413, bodies not received
    within ``body_timeout`` seconds with 408. ``prepare_workers`` threads parse,
    render and tokenize requests off the event loop. ``log_requests`` logs one ``request`` event
    per ended request (the access log).
    """
    metrics = metrics or ServerMetrics(service.draft_width)
    # steps run by warmup and calibration are not serving traffic
    service.engine.add_observer(lambda report: metrics.observe_step(report) if service.ready else None)
    metrics.bind_queue(lambda: service.waiting, lambda: service.running, lambda: service.pending,
                       lambda: float(service.ready))
    preparer = RequestPreparer(service.tokenizer, model_name=model_name, vocab_size=service.vocab_size,
                               prompt_tokens=service.max_model_len - service.reserve - 1)
    workers = concurrent.futures.ThreadPoolExecutor(max_workers=prepare_workers, thread_name_prefix="dspark-prepare")
    generation = GenerationHandler(service, metrics, preparer, workers, completion_max_tokens=completion_max_tokens,
                                   max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                                   log_requests=log_requests)
    routes = [
        Route("/v1/completions", generation.completions, methods=["POST"]),
        Route("/v1/chat/completions", generation.chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {HTTPException: http_error, Exception: server_error}  # Starlette types them loosely
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    # Starlette would answer /v1/completions/ with a redirect built from the client's Host header
    app.router.redirect_slashes = False
    app.state.service = service
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.started = int(time.time())
    app.state.workers = workers
    app.state.drain_timeout = drain_timeout
    return app
