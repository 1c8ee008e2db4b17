"""The two generation endpoints: admission, the engine round trip, and the JSON or SSE answer.

One :class:`GenerationHandler` serves ``/v1/completions`` and
``/v1/chat/completions``: it checks the service can take work, reads the body
under its limits, prepares it on the worker pool, hands it to the service and
answers with one JSON body or an SSE stream. A client that goes away has its
request cancelled so the slot is freed at once. Every request ends in
:meth:`GenerationHandler.ended` exactly once, with the status it ended with: it
is counted in the metrics there and, unless request logging is off, logged as
one ``request`` event (the server's access log).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dspark_core.audit import get_logger
from dspark_core.engine.request import RequestOutput, SamplingParams
from dspark_core.server.events import Failed, Finished, Submission, Tokens
from dspark_core.server.failures import CLIENT_CLOSED, error_response, internal_error
from dspark_core.server.metrics import ServerMetrics
from dspark_core.server.prepare import RequestPreparer
from dspark_core.server.responses import (DONE, ChunkWriter, ClientGone, TextDeltas, check_content_type,
                                          completion_body, dspark_summary, new_id, read_body, wait_disconnect)
from dspark_core.server.schema import ApiError, GenerationRequest, check_lengths
from dspark_core.server.service import AsyncEngineService


class GenerationHandler:
    """Handles generation requests for one service; ``completions`` and ``chat_completions`` are the routes."""

    def __init__(self, service: AsyncEngineService, metrics: ServerMetrics, preparer: RequestPreparer,
                 workers: concurrent.futures.Executor, *, completion_max_tokens: int, max_body_bytes: int,
                 body_timeout: float, log_requests: bool = True) -> None:
        self.service = service
        self.metrics = metrics
        self.preparer = preparer
        self.workers = workers
        self.model_name = preparer.model_name
        self.completion_max_tokens = completion_max_tokens
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.log = get_logger("server") if log_requests else None

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool) -> Response:
        """Admit, prepare and submit one request, then answer it; a bug becomes a 500 with a log reference."""
        endpoint = "chat" if chat else "completions"
        # the client's X-Request-Id is echoed and logged (client_request_id), refusals included
        client_id = request.headers.get("x-request-id")
        echo = {"X-Request-Id": client_id} if client_id else None
        try:
            try:
                req, sub = await self._submit(request, chat)
            except ApiError as error:
                self.ended(endpoint, error.status, error=error, client_id=client_id)
                return error_response(error, headers=echo)
            except ClientGone:
                self.ended(endpoint, CLIENT_CLOSED, client_id=client_id)
                return Response(status_code=CLIENT_CLOSED)
            sub.client_request_id = client_id
            return await self.respond(request, sub, req, chat, endpoint)
        except Exception as exc:
            failure = internal_error(request.url.path, exc)
            self.ended(endpoint, 500, error=failure, client_id=client_id)
            return error_response(failure, headers=echo)

    async def _submit(self, request: Request, chat: bool) -> tuple[GenerationRequest, Submission]:
        service = self.service
        refusal = service.unavailable()
        if refusal is not None:
            raise refusal
        check_content_type(request.headers.get("content-type"))
        body = await read_body(request, self.max_body_bytes, self.body_timeout)
        loop = asyncio.get_running_loop()
        req, ids = await loop.run_in_executor(self.workers, self.preparer.prepare, body, chat)
        max_tokens = check_lengths(len(ids), req.max_tokens, max_model_len=service.max_model_len,
                                   reserve=service.reserve,
                                   default_max_tokens=None if chat else self.completion_max_tokens, chat=chat,
                                   field=req.max_tokens_field)
        params = SamplingParams(max_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos)
        return req, service.submit(ids, params, stream=req.stream)

    async def respond(self, request: Request, sub: Submission, req: GenerationRequest, chat: bool,
                      endpoint: str) -> Response:
        """The SSE stream, or the one JSON body once the request finished."""
        rid = new_id(chat)
        # X-Request-Id: the client's own, echoed, or else the response's id, so a client can quote
        # the request before it parses the body
        header = {"X-Request-Id": sub.client_request_id or rid}
        if req.stream:
            return StreamingResponse(self.stream(sub, req, rid, endpoint), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **header})
        event = await self.wait_final(sub, request)
        if event is None or (isinstance(event, Finished) and event.output is None):  # the client went away
            self.ended(endpoint, CLIENT_CLOSED, sub=sub, rid=rid)
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(event, Failed):
            self.ended(endpoint, event.error.status, sub=sub, error=event.error, rid=rid)
            return error_response(event.error, headers=header)
        output = event.output
        assert output is not None  # a Finished event without output was handled above
        self.record(sub, event)
        body = completion_body(rid, int(time.time()), self.model_name, chat=chat, text=output.text, output=output,
                               token_ids=req.return_token_ids)
        self.ended(endpoint, 200, sub=sub, output=output, rid=rid)
        return JSONResponse(body, headers=header)

    def ended(self, endpoint: str, status: int, *, sub: Submission | None = None, output: RequestOutput | None = None,
              error: ApiError | None = None, rid: str | None = None, client_id: str | None = None) -> None:
        """A request ended with ``status``: count it in the metrics and log its one ``request`` event.

        The event carries what is known of it: refused before admission, only the status and the
        error; admitted, its prompt length, seconds since admission and time to first token; finished,
        its tokens, finish reason and how speculation went (steps, accepted length per step).
        """
        self.metrics.count_request(endpoint, status)
        if self.log is None:
            return
        event: dict[str, Any] = {"endpoint": endpoint, "status": status}
        if rid is not None:
            event["id"] = rid  # the response's id, as the client sees it
        client_id = client_id or (sub.client_request_id if sub is not None else None)
        if client_id:
            event["client_request_id"] = client_id[:128]  # the client's X-Request-Id
        if sub is not None:
            event.update(stream=sub.stream, prompt_tokens=len(sub.prompt), completion_tokens=sub.sent,
                         seconds=round(time.monotonic() - sub.submitted, 4))
            if sub.first_token is not None:
                event["ttft_seconds"] = round(sub.first_token - sub.submitted, 4)
        if output is not None:
            event.update(request_id=output.request_id, completion_tokens=len(output.token_ids),
                         finish_reason=output.finish_reason, steps=output.steps,
                         accepted_length=round(output.accepted_length, 3), draft_off_steps=output.draft_off_steps,
                         copy_steps=output.copy_steps)
        if error is not None:
            event.update(error_code=error.code, error=error.message)
        (self.log.error if status >= 500 else self.log.info)("request", **event)

    def record(self, sub: Submission, event: Finished) -> None:
        """Request-level metrics (tokens, latencies, finish reason) of a finished request."""
        n = len(event.output.token_ids) if event.output is not None else sub.sent
        self.metrics.observe_request(prompt_tokens=len(sub.prompt), output_tokens=n, reason=event.reason,
                                     submitted=sub.submitted, first_token=sub.first_token, last_token=sub.last_token)

    async def wait_final(self, sub: Submission, request: Request) -> Finished | Failed | None:
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
            self.service.cancel(sub)  # a no-op once the request finished

    async def stream(self, sub: Submission, req: GenerationRequest, rid: str, endpoint: str) -> AsyncIterator[bytes]:
        """SSE chunks of one request: text deltas as tokens commit, then the final chunk, usage and ``[DONE]``."""
        writer = ChunkWriter(rid, self.model_name, chat=req.chat)
        deltas = TextDeltas(self.service.tokenizer, req.stop)
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
                for chunk in self._final_chunks(sub, req, event, writer, deltas, endpoint):
                    yield chunk
                return
        except Exception as exc:  # a bug while streaming: end this stream cleanly, keep serving the others
            finished = True
            self.service.cancel(sub)
            error = internal_error(f"stream {rid}", exc)
            self.ended(endpoint, 500, sub=sub, error=error, rid=rid)
            yield b"data: " + JSONResponse(error.body()).body + b"\n\n"
            yield DONE
        finally:
            if not finished:  # the client disconnected mid-stream (or the server is closing the connection)
                self.service.cancel(sub)
                self.ended(endpoint, CLIENT_CLOSED, sub=sub, rid=rid)

    def _final_chunks(self, sub: Submission, req: GenerationRequest, event: Finished | Failed, writer: ChunkWriter,
                      deltas: TextDeltas, endpoint: str) -> list[bytes]:
        """What ends a stream: the error, or the last text with the summary (and usage); then ``[DONE]``.

        Metrics are recorded before the chunks go out, as the client may close
        the connection as soon as it has read them.
        """
        if isinstance(event, Failed):
            self.ended(endpoint, event.error.status, sub=sub, error=event.error, rid=writer.rid)
            return [b"data: " + JSONResponse(event.error.body()).body + b"\n\n", DONE]
        output = event.output
        if output is None:  # the engine dropped the request (shutdown): end the stream as a bug would
            raise RuntimeError("request finished without an output")
        rest = deltas.finish(output.text)
        summary = dspark_summary(output, token_ids=False)
        if req.return_token_ids:
            summary["token_ids"] = list(output.token_ids[len(deltas.ids):])
        last = writer.chunk(rest, output.finish_reason, extra={"dspark": summary})
        usage = writer.usage_chunk(output.prompt_tokens, len(output.token_ids)) if req.include_usage else b""
        self.record(sub, event)
        self.ended(endpoint, 200, sub=sub, output=output, rid=writer.rid)
        return [last, usage, DONE] if usage else [last, DONE]
