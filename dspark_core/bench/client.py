"""``--url`` mode: the same closed-loop measurement against a running server over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx
from tqdm import tqdm

from dspark_core.bench.run import CellRecord, RequestRecord, pool
from dspark_core.errors import DSparkError


class ServerError(DSparkError):
    """The server of ``--url`` could not be reached, or answered a request with an error."""


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: Any, index: int, max_tokens: int) -> RequestRecord:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    record = RequestRecord(index, time.perf_counter())
    ids: list[int] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise ServerError(f"--url: {url}/v1/chat/completions answered prompt {index} with HTTP "
                              f"{response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            extra = chunk.get("dspark") or {}
            if extra.get("token_ids"):
                ids += extra["token_ids"]
                record.first_token = record.first_token or time.perf_counter()
            if "steps" in extra:
                record.steps = extra["steps"]
                record.accepted = round((extra["accepted_length"] - 1) * extra["steps"])
                record.verified = round(record.accepted / extra["acceptance"]) if extra["acceptance"] else 0
                record.verify_widths = [round(extra["verify_widths"]["mean"])] * extra["steps"]
    record.finished = time.perf_counter()
    record.first_token = record.first_token or record.finished
    record.token_ids = tuple(ids)
    return record


async def _cell(url: str, model: str, prompts: Sequence[Any], count: int, concurrency: int, max_tokens: int,
                finished: Any = None) -> CellRecord:
    cell = CellRecord("server", concurrency)
    queue = list(range(min(count, len(prompts))))
    async with httpx.AsyncClient(timeout=None) as client:
        async def worker() -> None:
            while queue:
                index = queue.pop(0)
                cell.requests.append(await _one(client, url, model, prompts[index], index, max_tokens))
                if finished is not None:
                    finished(1)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cell.wall_seconds = time.perf_counter() - started
    return cell


def server_model(url: str) -> str:
    """The model id the server reports (needed in every request); a server that cannot be reached or
    is not ready yet is a :class:`ServerError` saying so."""
    try:
        ready = httpx.get(f"{url}/ready", timeout=30)
        models = httpx.get(f"{url}/v1/models", timeout=30)
    except httpx.HTTPError as exc:
        raise ServerError(f"--url: cannot reach {url} ({exc.__class__.__name__}: {exc}); is the server running?") from None
    if ready.status_code == 503:  # (a server without /ready answers 404: it is not asked to have one)
        raise ServerError(f"--url: {url}/ready answered HTTP 503: the server is not ready yet (still "
                          "calibrating?); wait for /ready to answer 200")
    try:
        return str(models.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"--url: {url}/v1/models did not list a model (HTTP {models.status_code}); is this a "
                          "dspark-core or OpenAI-compatible server?") from None


def run_against_server(url: str, prompts: Sequence[Any], concurrencies: Sequence[int], counts: Sequence[int],
                       max_tokens: int, *, rounds: int = 1, progress: bool = False) -> list[CellRecord]:
    """One cell per concurrency against ``url`` (the server's own policy), pooled over ``rounds`` runs
    of its prompts."""
    url = url.rstrip("/")
    model = server_model(url)
    total = rounds * sum(min(n, len(prompts)) for n in counts)
    cells = []
    with tqdm(total=total, desc="bench", unit="request", disable=not progress) as bar:
        for c, n in zip(concurrencies, counts):
            runs = [asyncio.run(_cell(url, model, prompts, n, c, max_tokens, bar.update)) for _ in range(rounds)]
            cells.append(pool("server", c, runs))
    return cells
