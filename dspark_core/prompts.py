"""Prompt files shared by ``generate``, ``bench`` and ``eval-draft``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from dspark_core.errors import ConfigError


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) of every non-blank line of a JSONL file; a file that cannot be read
    or a line that is not JSON is a ConfigError naming the path (and line)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from None


def read_prompts_jsonl(path: str | os.PathLike) -> list[Any]:
    """JSONL prompts: each line an object with ``prompt`` (text) or ``messages`` (chat turns)."""
    items: list[Any] = []
    for number, record in jsonl_records(path):
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            items.append(record["prompt"])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            items.append(record["messages"])
        else:
            raise ConfigError(f"{path}:{number}: expected an object with a `prompt` string or a `messages` list")
    if not items:
        raise ConfigError(f"{path}: no prompts")
    return items
