"""Strict validation of OpenAI-style request bodies.

Every rejection is an :class:`ApiError` whose message names the offending
field. The accepted fields are listed in :data:`COMMON_FIELDS`,
:data:`COMPLETION_FIELDS` and :data:`CHAT_FIELDS`; anything else is refused
rather than silently ignored, so a client never believes a setting took effect
when it did not. Decoding is greedy only, so ``temperature`` must be sent and
must be 0. An optional field sent as ``null`` takes its default.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from attrs import frozen

from dspark_core.server import fields as f
from dspark_core.server.fields import JSON_NAMES, ApiError, bad

__all__ = ["ApiError", "GenerationRequest", "check_lengths", "parse_json", "parse_request"]


COMMON_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "model": f.string,
    "temperature": f.temperature,
    "max_tokens": f.max_tokens,
    "stream": f.boolean,
    "stream_options": f.stream_options,
    "stop": f.stop,
    "n": f.n,
    "user": f.string,
    "seed": f.seed,
    "top_p": f.fixed_number(1, "greedy decoding"),
    "presence_penalty": f.fixed_number(0, "penalties are not supported"),
    "frequency_penalty": f.fixed_number(0, "penalties are not supported"),
    "ignore_eos": f.boolean,  # extension (as in vLLM): keep decoding past end-of-sequence tokens
    "return_token_ids": f.boolean,  # extension: the output token ids in the dspark object
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": f.prompt}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": f.messages, "max_completion_tokens": f.max_tokens}


@frozen
class GenerationRequest:
    """A validated request; ``prompt`` is text or token ids, ``messages`` a chat conversation."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None  # role, content and, when sent, name
    max_tokens: int | None
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    ignore_eos: bool
    return_token_ids: bool
    max_tokens_field: str = "max_tokens"  # the name the client gave its output limit (errors quote it)


class _Refused(ValueError):
    """A JSON construct the parser accepts but this server refuses (NaN, duplicate keys)."""


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    for key, _ in pairs:
        # an error naming an unknown key quotes it, and a lone surrogate cannot be written back as UTF-8
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _Refused(f"an object key holds a lone surrogate U+{ord(key[exc.start]):04X} (an unpaired "
                           "\\ud800-\\udfff escape); keys must be valid Unicode") from None
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]  # add() marks it seen
        raise _Refused(f"duplicate key {dup!r} in an object")
    return data


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; anything else is a 400 ``invalid_json`` whose message says why.

    Stricter than ``json.loads``: the body must be UTF-8, ``NaN``/``Infinity``
    and duplicate keys are refused, and inputs that make the parser raise
    something other than a decode error (integers over Python's digit limit,
    nesting deeper than the recursion limit) are refused as well.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: not UTF-8 (byte 0x{body[exc.start]:02x} at offset "
                       f"{exc.start})", code="invalid_json") from None
    try:
        data = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except _Refused as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON for this server: arrays/objects nested too deeply",
                       code="invalid_json") from None
    except ValueError as exc:  # e.g. an integer literal longer than sys.get_int_max_str_digits()
        reason = ("an integer has too many digits" if "digits" in str(exc) else "a value cannot be read")
        raise ApiError(400, f"request body is not valid JSON for this server: {reason}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {JSON_NAMES.get(type(data), 'value')}",
                       code="invalid_json")
    return data


def parse_request(body: bytes, *, chat: bool) -> GenerationRequest:
    """Validate a /v1/completions (``chat=False``) or /v1/chat/completions body."""
    data = parse_json(body)
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    main = "messages" if chat else "prompt"
    # an optional field sent as null means "the default", as in OpenAI's API (clients built from
    # typed models send every field, e.g. logprobs: null): it asks for nothing, even one this server
    # does not know; the required ones must carry a value
    data = {name: value for name, value in data.items() if value is not None or name in (main, "temperature")}
    unknown = sorted(k for k in data if k not in fields)
    if unknown:
        named = ", ".join(map(f.shown_key, unknown[:10])) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise bad(f.shown_key(unknown[0]), f"unknown field{'s' if len(unknown) > 1 else ''} {named} "
                  f"(supported: {', '.join(sorted(fields))})", "unknown_field")
    for required in (main, "temperature"):
        if required not in data:
            hint = " (this server decodes greedily only: send temperature=0)" if required == "temperature" else ""
            raise bad(required, f"required{hint}", "missing_field")
    values = {name: fields[name](name, value) for name, value in data.items()}
    max_tokens, max_tokens_field = values.get("max_tokens"), "max_tokens"
    if chat and values.get("max_completion_tokens") is not None:
        if max_tokens is not None and max_tokens != values["max_completion_tokens"]:
            raise bad("max_completion_tokens", f"differs from max_tokens ({values['max_completion_tokens']} vs {max_tokens})")
        if max_tokens is None:  # (both sent and equal: the older name is quoted)
            max_tokens_field = "max_completion_tokens"
        max_tokens = values["max_completion_tokens"]
    stream = values.get("stream", False)
    if "stream_options" in values and not stream:
        raise bad("stream_options", "only allowed with stream=true")
    return GenerationRequest(chat, values.get("model"), values.get("prompt"), values.get("messages"), max_tokens,
                             stream, values.get("stream_options", False), values.get("stop", ()),
                             values.get("ignore_eos", False), values.get("return_token_ids", False),
                             max_tokens_field)


def check_lengths(prompt_tokens: int, max_tokens: int | None, *, max_model_len: int, reserve: int,
                  default_max_tokens: int | None, chat: bool = False, field: str = "max_tokens") -> int:
    """The request's effective max_tokens, or a 400 quoting the numbers when it does not fit.

    ``reserve`` context positions are kept free for speculation (two launched
    steps of draft width + 1 rows). A missing max_tokens becomes
    ``default_max_tokens`` capped to the room left, or all of it when None. A chat request's
    prompt is its messages in the chat template, and the error names ``messages``; an output limit
    that does not fit is named ``field``, as the client sent it.
    """
    usable = max_model_len - reserve
    room = usable - prompt_tokens
    if room < 1:
        what = "messages: the conversation in the chat template is" if chat else "prompt is"
        raise ApiError(400, f"{what} {prompt_tokens} tokens; this model's context is {max_model_len} tokens, of "
                       f"which {reserve} are reserved for speculation, so a prompt may have at most {usable - 1} "
                       "tokens", param="messages" if chat else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        return room if default_max_tokens is None else min(default_max_tokens, room)
    if max_tokens > room:
        raise ApiError(400, f"{field}: prompt ({prompt_tokens} tokens) + {field} ({max_tokens}) = "
                       f"{prompt_tokens + max_tokens} exceeds the {usable} tokens available (context "
                       f"{max_model_len} minus {reserve} reserved for speculation); at most {room} output tokens "
                       "fit", param=field, code="context_length_exceeded")
    return max_tokens
