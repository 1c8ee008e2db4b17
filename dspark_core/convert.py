"""The one strict cattrs converter used for every JSON file dspark-core reads.

Unknown keys and wrong types are errors; the message names the JSON path in
the ``$.contexts[0].max_kv_length`` style so a user can find the bad field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.v import transform_error

from dspark_core.errors import ConfigError

T = TypeVar("T")


# Typed attrs converters for tuple fields. ``converter=tuple`` works the same at run time, but
# mypy's attrs plugin cannot solve tuple's type variable and rejects every caller.
def int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    """The values as a tuple of ints (attrs converter)."""
    return tuple(values)


def float_tuple(values: Iterable[float]) -> tuple[float, ...]:
    """The values as a tuple of floats (attrs converter)."""
    return tuple(values)


def str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    """The values as a tuple of strings (attrs converter)."""
    return tuple(values)


def _strict_int(value: Any, _type: type) -> int:
    # JSON true/false must not pass as 1/0, and 1.5 must not silently become 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _strict_float(value: Any, _type: type) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _strict_str(value: Any, _type: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _strict_bool(value: Any, _type: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def make_converter() -> cattrs.Converter:
    """Build the strict converter (exposed for plugins that add their own classes)."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    return conv


converter = make_converter()


def _describe(exc: BaseException) -> list[str]:
    messages = transform_error(exc, path="$")
    out = []
    for message in messages:
        # cattrs writes "extra fields found (x) @ $"; say which key is unknown and where.
        out.append(message.replace("extra fields found", "unknown key(s)"))
    return out


def structure_strict(data: Any, cls: type[T], *, source: str = "input") -> T:
    """Structure ``data`` into ``cls`` or raise :class:`ConfigError` naming each bad path."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a JSON object at $, got {type(data).__name__}")
    try:
        return converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        details = "; ".join(_describe(exc))
        raise ConfigError(f"{source}: {details}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


_UNKNOWN = re.compile(r"unknown error \((.*?)\) @ ")


def structure_checked(data: Any, cls: type[T], *, source: str) -> T:
    """:func:`structure_strict`, with our own rule violations shown plainly.

    cattrs labels exceptions it does not know (our ConfigErrors raised by a
    value's own checks) as "unknown error (...)"; keep the message and path.
    """
    try:
        return structure_strict(data, cls, source=source)
    except ConfigError as exc:
        raise ConfigError(_UNKNOWN.sub(r"\1 @ ", str(exc))) from None


def load_json_file(path: str | Path, cls: type[T]) -> T:
    """Read ``path`` as JSON and structure it strictly into ``cls``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return structure_strict(data, cls, source=str(path))


def unstructure(obj: Any) -> Any:
    """Turn an attrs value object into plain JSON-able data."""
    return converter.unstructure(obj)
