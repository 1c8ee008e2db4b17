"""Turning a request body into a validated request and its prompt token ids (off the event loop).

Parsing, chat-template rendering and tokenizing may all be slow for a big
body, so the app runs :meth:`RequestPreparer.prepare` on a small worker pool.
Text too long to possibly fit the context is refused before it is tokenized.
"""

from __future__ import annotations

import contextlib
from typing import Any

from dspark_core.errors import DSparkError
from dspark_core.server.schema import ApiError, GenerationRequest, parse_request

PROMPT_SLACK = 2  # the cheap length guard allows this many times the characters that could possibly fit


def longest_token_chars(tokenizer: Any) -> int | None:
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


def _template_errors() -> tuple[type[BaseException], ...]:
    """What a failing chat template raises: our own errors, plus jinja2's when it is installed."""
    with contextlib.suppress(ImportError):
        from jinja2 import TemplateError

        return (DSparkError, TemplateError)
    return (DSparkError,)


def model_not_found(requested: str, served: str) -> ApiError:
    """The 404 for a request (or a model lookup) naming a model this server does not serve."""
    shown = requested if len(requested) <= 200 else requested[:200] + "..."
    return ApiError(404, f"model: {shown!r} is not served here; this server serves {served!r}", param="model",
                    code="model_not_found", kind="not_found_error")


class RequestPreparer:
    """Parse, validate, render and tokenize generation requests for one served model."""

    def __init__(self, tokenizer: Any, *, model_name: str, vocab_size: int, prompt_tokens: int) -> None:
        """``prompt_tokens`` is the most tokens a prompt may have (the context less the speculation reserve)."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.prompt_tokens = prompt_tokens
        self.longest = longest_token_chars(tokenizer)
        self.text_limit = None if self.longest is None else PROMPT_SLACK * self.longest * max(prompt_tokens, 1)
        self.template_errors = _template_errors()

    def prepare(self, body: bytes, chat: bool) -> tuple[GenerationRequest, list[int]]:
        """The validated request and its prompt ids; raises :class:`ApiError` for anything a client must fix."""
        req = parse_request(body, chat=chat)
        if req.model is not None and req.model != self.model_name:
            raise model_not_found(req.model, self.model_name)
        if req.stop and self.tokenizer is None:
            raise ApiError(400, "stop: stop strings need a tokenizer and this model has none", param="stop",
                           code="no_tokenizer")
        return req, self.encode(req)

    def encode(self, req: GenerationRequest) -> list[int]:
        """Prompt token ids: checked ids as given, or the (rendered) text tokenized."""
        if isinstance(req.prompt, list):
            return self._checked_ids(req.prompt)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt",
                           code="no_tokenizer")
        param = "messages" if req.chat else "prompt"
        text = self._chat_text(req) if req.chat else req.prompt
        assert isinstance(text, str)  # parse_request: a completion prompt is text or ids, never missing
        self.guard_length(param, len(text))
        try:
            return self.tokenizer.encode(text)
        except (TypeError, ValueError) as exc:  # input the tokenizer cannot take (validation should catch it first)
            raise ApiError(400, f"{param}: the tokenizer cannot encode this text ({type(exc).__name__})",
                           param=param, code="invalid_value") from None

    def _checked_ids(self, ids: list[int]) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            shown = str(bad) if abs(bad) < 10**30 else f"{str(bad)[:12]}... ({len(str(abs(bad)))} digits)"
            raise ApiError(400, f"prompt: token id {shown} is outside the vocabulary (0..{self.vocab_size - 1})",
                           param="prompt", code="invalid_value")
        return ids

    def _chat_text(self, req: GenerationRequest) -> str:
        """The rendered conversation; a message name the template would silently drop is refused."""
        messages = req.messages
        assert messages is not None  # parse_request: a chat request always has messages
        self.guard_length("messages", sum(len(m["content"]) for m in messages))
        text = self.render(messages)
        named = [i for i, m in enumerate(messages) if "name" in m]
        if named and self.render([{k: v for k, v in m.items() if k != "name"} for m in messages]) == text:
            where = f"messages[{named[0]}].name"
            raise ApiError(400, f"{where}: this model's chat template does not use message names, so the name "
                           "would be ignored; remove it (or put it in the content)", param=where,
                           code="unsupported_value")
        return text

    def render(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to ``messages``; a template error is the client's 400."""
        try:
            return self.tokenizer.apply_chat_template(messages)
        except self.template_errors as exc:
            raise ApiError(400, f"messages: {exc}", param="messages", code="chat_template") from None

    def guard_length(self, param: str, chars: int) -> None:
        """Refuse, without tokenizing, text too long to fit the context whatever its tokens."""
        if self.text_limit is not None and chars > self.text_limit:
            raise ApiError(400, f"{param}: {chars} characters cannot fit this model's context: a prompt may have "
                           f"at most {self.prompt_tokens} tokens and no token spans more than {self.longest} characters",
                           param=param, code="context_length_exceeded")
