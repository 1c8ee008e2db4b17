"""Prompt files shared by ``generate``, ``bench`` and ``eval-draft``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dspark_core.errors import ConfigError


def read_prompts_jsonl(path: str | os.PathLike) -> list[Any]:
    """JSONL prompts: each line an object with ``prompt`` (text) or ``messages`` (chat turns)."""
    items: list[Any] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            items.append(record["prompt"])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            items.append(record["messages"])
        else:
            raise ConfigError(f"{path}:{number}: expected an object with a `prompt` string or a `messages` list")
    if not items:
        raise ConfigError(f"{path}: no prompts")
    return items
