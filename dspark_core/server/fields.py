"""Field checkers for request bodies: each takes (field name, JSON value) and returns the
normalised value or raises a 400 ApiError that names the field and the expected type."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant")
# content part types of OpenAI's chat API that carry something other than text
NON_TEXT_PARTS = ("image_url", "input_audio", "file", "refusal", "video_url", "audio_url")


class ApiError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


#: Longest key name an error quotes in full: a client-chosen key (an unknown field) may be megabytes long.
SHOWN_KEY_CHARS = 64


def shown_key(key: str) -> str:
    """A client-chosen key as an error quotes it: cut after :data:`SHOWN_KEY_CHARS` characters."""
    return key if len(key) <= SHOWN_KEY_CHARS else f"{key[:SHOWN_KEY_CHARS]}… ({len(key)} characters)"


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


def json_name(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "a number out of range"  # 1e999 parses to inf
    return JSON_NAMES.get(type(value), type(value).__name__)


def _type_error(param: str, expected: str, value: Any) -> ApiError:
    return bad(param, f"expected {expected}, got {json_name(value)}", "invalid_type")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and not (isinstance(value, float) and not math.isfinite(value))


def check_unicode(name: str, value: str) -> str:
    """Refuse strings a tokenizer cannot encode: JSON's \\uXXXX escapes can produce lone UTF-16 surrogates."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(name, f"contains a lone surrogate U+{ord(value[exc.start]):04X} at character {exc.start} "
                  "(an unpaired \\ud800-\\udfff escape); text must be valid Unicode") from None
    return value


# -- field checkers: (name, value) -> normalised value -----------------------------
def string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _type_error(name, "string", value)
    return check_unicode(name, value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "boolean", value)
    return value


def seed(name: str, value: Any) -> int | None:
    if value is not None and not _is_int(value):
        raise _type_error(name, "integer or null", value)
    return value


def max_tokens(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise _type_error(name, "integer or null", value)
    if value < 1:
        raise bad(name, f"must be at least 1, got {value}")
    return value


def fixed_number(expected: float, why: str) -> Callable[[str, Any], float]:
    def check(name: str, value: Any) -> float:
        if not _is_number(value):
            raise _type_error(name, "number", value)
        if value != expected:
            raise bad(name, f"must be {expected:g} ({why}), got {value}", "unsupported_value")
        return value
    return check


def temperature(name: str, value: Any) -> float:
    if not _is_number(value):
        raise _type_error(name, "number (0)", value)
    if value != 0:
        raise bad(name, f"must be 0: this server decodes greedily only, got {value}", "unsupported_value")
    return 0.0


def n(name: str, value: Any) -> int:
    if not _is_int(value):
        raise _type_error(name, "integer", value)
    if value != 1:
        raise bad(name, f"must be 1 (one choice per request), got {value}", "unsupported_value")
    return value


def stop(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error(name, "string, array of strings or null", value)
    if len(items) > MAX_STOP_STRINGS:
        raise bad(name, f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    if any(s == "" for s in items):
        raise bad(name, "stop strings must not be empty")
    for i, s in enumerate(items):
        check_unicode(name if isinstance(value, str) else f"{name}[{i}]", s)
    return tuple(items)


def stream_options(name: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _type_error(name, "object or null", value)
    for key in value:
        if key != "include_usage":
            raise bad(f"{name}.{shown_key(key)}", "unknown field (only include_usage is supported)", "unknown_field")
    return boolean(f"{name}.include_usage", value.get("include_usage", False))


def prompt(name: str, value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad(name, "must not be empty")
        return check_unicode(name, value)
    if not isinstance(value, list):
        raise _type_error(name, "string or array of token ids (integers)", value)
    if not value:
        raise bad(name, "must not be empty")
    if all(isinstance(t, str) for t in value):
        if len(value) == 1:  # one prompt wrapped in a list, as some completion clients send it
            return prompt(name, value[0])
        raise bad(name, f"an array of {len(value)} strings is several prompts; this server takes one prompt per "
                  "request (send a string, an array of one string, or an array of token ids)", "unsupported_value")
    for i, token in enumerate(value):
        if not _is_int(token):
            raise _type_error(f"{name}[{i}]", "integer token id", token)
    return list(value)


def content(name: str, value: Any) -> str:
    """A message's content: a string, or an array of text parts (joined with newlines)."""
    if isinstance(value, str):
        return check_unicode(name, value)
    if not isinstance(value, list):
        raise _type_error(name, "string or array of text parts", value)
    if not value:
        raise bad(name, "must not be empty (send a string or at least one text part)")
    texts = []
    for j, part in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise _type_error(where, 'object {"type": "text", "text": ...}', part)
        if "type" not in part:
            raise bad(f"{where}.type", "required", "missing_field")
        kind = string(f"{where}.type", part["type"])
        if kind != "text":
            known = "is not supported" if kind in NON_TEXT_PARTS else "is not a known content part type"
            raise bad(f"{where}.type", f"{kind!r} {known}: this server reads text only (send a string or "
                      "parts of type 'text')", "unsupported_value")
        for key in part:
            if key not in ("type", "text"):
                raise bad(f"{where}.{shown_key(key)}", "unknown field (a text part has type and text)", "unknown_field")
        if "text" not in part:
            raise bad(f"{where}.text", "required", "missing_field")
        texts.append(string(f"{where}.text", part["text"]))
    return "\n".join(texts)


def messages(name: str, value: Any) -> list[dict[str, str]]:
    """Chat messages as ``{"role", "content"[, "name"]}`` dicts; text parts are joined into one string."""
    if not isinstance(value, list):
        raise _type_error(name, "array of message objects", value)
    if not value:
        raise bad(name, "must not be empty")
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise _type_error(where, "object with role and content", message)
        # a null field asks for nothing (typed clients send e.g. tool_calls: null on assistant turns)
        message = {key: field for key, field in message.items() if field is not None or key in ("role", "content")}
        for key in message:
            if key not in ("role", "content", "name"):
                raise bad(f"{where}.{shown_key(key)}", "unknown field (role, content and name are supported)", "unknown_field")
        for key in ("role", "content"):
            if key not in message:
                raise bad(f"{where}.{key}", "required", "missing_field")
        role = string(f"{where}.role", message["role"])
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        checked = {"role": role, "content": content(f"{where}.content", message["content"])}
        if "name" in message:
            checked["name"] = string(f"{where}.name", message["name"])
            if not checked["name"]:
                raise bad(f"{where}.name", "must not be empty")
        out.append(checked)
    if all(not m["content"] for m in out):
        raise bad(name, "every message is empty")
    return out
