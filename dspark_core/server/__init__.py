"""OpenAI-compatible HTTP serving.

Wiring (what ``dspark-core serve`` does)::

    service = AsyncEngineService(engine, max_pending=256)
    app = build_app(service, model_name="smollm2")
    service.prepare(calibrate_and_install)  # on the engine thread; marks ready when it returns
    serve_http(app, host, port)             # /health 200 and /ready 503 meanwhile

Modules: :mod:`.service` (engine thread, admission, cancellation),
:mod:`.schema` (request validation), :mod:`.responses` (OpenAI shapes, SSE),
:mod:`.metrics` (Prometheus), :mod:`.app` (routes and the small endpoints),
:mod:`.generation` (the two generation endpoints), :mod:`.prepare` (parse,
render, tokenize off the event loop), :mod:`.failures` (error bodies),
:mod:`.http` (uvicorn).
"""

from dspark_core.server.app import build_app
from dspark_core.server.http import BackgroundServer, HttpLimits, serve_http
from dspark_core.server.metrics import ServerMetrics
from dspark_core.server.schema import ApiError
from dspark_core.server.service import AsyncEngineService

__all__ = ["ApiError", "AsyncEngineService", "BackgroundServer", "HttpLimits", "ServerMetrics", "build_app", "serve_http"]
