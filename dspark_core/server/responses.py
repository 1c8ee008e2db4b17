"""OpenAI-shaped response bodies, SSE chunks, incremental detokenization and small HTTP helpers."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from typing import Any

from dspark_core.engine.request import RequestOutput
from dspark_core.server.fields import ApiError

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def dspark_summary(output: RequestOutput, *, token_ids: bool) -> dict[str, Any]:
    """The ``dspark`` extension object: speculation figures of one request."""
    widths = output.verify_widths
    summary: dict[str, Any] = {
        "steps": output.steps,
        "acceptance": round(output.acceptance, 6),
        "accepted_length": round(output.accepted_length, 6),
        "verify_widths": {
            "mean": round(sum(widths) / len(widths), 6) if widths else 0.0,
            "min": min(widths, default=0),
            "max": max(widths, default=0),
            "counts": {str(w): n for w, n in sorted(Counter(widths).items())},
        },
    }
    if token_ids:
        summary["token_ids"] = list(output.token_ids)
    return summary


def completion_body(rid: str, created: int, model: str, *, chat: bool, text: str, output: RequestOutput,
                    token_ids: bool) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": output.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(output.prompt_tokens, len(output.token_ids)),
            "dspark": dspark_summary(output, token_ids=token_ids)}


class ChunkWriter:
    """SSE chunks of one streamed response (``data: {...}`` lines, ``data: [DONE]`` last)."""

    def __init__(self, rid: str, model: str, *, chat: bool) -> None:
        self.rid, self.model, self.chat = rid, model, chat
        self.created = int(time.time())

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              extra: dict[str, Any] | None = None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}
        if extra:
            body.update(extra)
        return sse(body)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse({"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens)})


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class TextDeltas:
    """Turns a growing list of token ids into text pieces that never need to be taken back.

    Text is held back while it ends in an incomplete UTF-8 sequence and, when
    the request has stop strings, for the last ``len(longest stop) - 1``
    characters (a stop string might still complete there; the engine cuts the
    final text before it). Decoding restarts from a recent offset, so each
    step costs a few tokens' decode, not the whole output's.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # decode window: ids[prefix:read] is already in self.text
        self.text = ""  # detokenized text so far (complete characters only)
        self.emitted = 0  # characters of self.text already sent

    def add(self, ids) -> str:
        """Append token ids; return the text that is now safe to send."""
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT) and after.startswith(before):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        safe = len(self.text) - self.holdback
        if safe <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:safe], safe
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the authoritative final text (the engine's stop-cut decode)."""
        sent = self.text[: self.emitted]
        rest = final_text[len(sent):] if final_text.startswith(sent) else ""
        self.emitted = len(self.text)
        return rest


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def check_content_type(value: str | None) -> None:
    """Generation bodies must be ``application/json`` (UTF-8): anything else is a 415.

    Browsers send cross-site form posts (``text/plain``, form encodings) without
    a CORS preflight; refusing them keeps other web pages from starting
    generations on a server they can reach.
    """
    def refuse(message: str) -> ApiError:
        return ApiError(415, f"Content-Type: {message}", code="unsupported_media_type")

    if value is None:
        raise refuse("missing; send the body as application/json")
    media, _, parameters = value.partition(";")
    shown = value if len(value) <= 100 else value[:100] + "..."
    if media.strip().lower() != "application/json":
        raise refuse(f"expected application/json, got {shown!r}")
    for parameter in parameters.split(";"):
        key, _, charset = parameter.partition("=")
        charset = charset.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise refuse(f"charset {charset!r} is not supported; JSON bodies must be UTF-8 (got {shown!r})")


async def read_body(request, limit: int, timeout: float | None = None) -> bytes:
    """The request body; a 413 ApiError as soon as it is known to exceed ``limit`` bytes, a 408 when it
    has not fully arrived within ``timeout`` seconds, ClientGone when the client disconnects first."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    too_big = ApiError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body: not received within {timeout:g} s ({size} bytes arrived)",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


async def wait_disconnect(request) -> None:
    """Return when the client closes the connection (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
