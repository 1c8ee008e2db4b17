"""``--url`` mode: the same closed-loop measurement against a running server over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from dspark_core.bench.run import CellRecord, RequestRecord


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: Any, index: int, max_tokens: int) -> RequestRecord:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    record = RequestRecord(index, time.perf_counter())
    ids: list[int] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
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


async def _cell(url: str, model: str, prompts: Sequence[Any], count: int, concurrency: int, max_tokens: int) -> CellRecord:
    cell = CellRecord("server", concurrency)
    queue = list(range(min(count, len(prompts))))
    async with httpx.AsyncClient(timeout=None) as client:
        async def worker() -> None:
            while queue:
                index = queue.pop(0)
                cell.requests.append(await _one(client, url, model, prompts[index], index, max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cell.wall_seconds = time.perf_counter() - started
    return cell


def server_model(url: str) -> str:
    """The model id the server reports (needed in every request)."""
    data = httpx.get(f"{url}/v1/models", timeout=30).json()
    return data["data"][0]["id"]


def run_against_server(url: str, prompts: Sequence[Any], concurrencies: Sequence[int], counts: Sequence[int],
                       max_tokens: int) -> list[CellRecord]:
    """One cell per concurrency against ``url`` (the server's own policy)."""
    model = server_model(url)
    return [asyncio.run(_cell(url, model, prompts, n, c, max_tokens)) for c, n in zip(concurrencies, counts)]
