"""How a failure reaches an HTTP client: the OpenAI error body, and a 500 that names a log reference."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from starlette.responses import JSONResponse

from dspark_core.server.schema import ApiError

# The app's own logger name: operators filter server errors by it.
log = logging.getLogger("dspark_core.server.app")
CLIENT_CLOSED = 499  # status recorded in metrics for requests whose client went away


class _AsciiJSON(JSONResponse):
    """JSON written with non-ASCII characters escaped: an error that quotes what a client sent can then
    always be written, even text that is not valid Unicode (a lone surrogate)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(error: ApiError, *, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI error body (a request body left unread is drained under the HTTP layer's deadline)."""
    headers = dict(headers or {})
    if error.status in (429, 503):
        headers["Retry-After"] = "1"
    return _AsciiJSON(error.body(), status_code=error.status, headers=headers or None)


def internal_error(where: str, exc: BaseException) -> ApiError:
    """A 500 that names a log reference instead of the exception (whose text may expose internals)."""
    ref = uuid.uuid4().hex[:12]
    log.error("unhandled error (reference %s) in %s", ref, where, exc_info=exc)
    return ApiError(500, f"internal server error (reference {ref} in the server log)", code="internal_error",
                    kind="server_error")
